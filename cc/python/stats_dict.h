// The runtime's statistics as the dict perseus_tf._core.stats() returns.
#pragma once

#include <pybind11/pybind11.h>

#include "cc/runtime/stats.h"

namespace perseus {

pybind11::dict StatsToDict(const Stats& st);

}  // namespace perseus
