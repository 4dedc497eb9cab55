// Staging: running a collective over requests whose memory is not where the
// collective runs. Lifted: host requests of a device bucket (a rank's
// stand-ins, host tensors fused with device ones) copied onto the device and
// their results copied back, so that device kernels and NCCL only ever see
// device memory. Staged: device requests copied to host memory for
// collectives with no device path of their own, and their results copied
// back (outputs allocated by the collective included).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "cc/device/data_plane.h"
#include "cc/runtime/request.h"

namespace perseus {

using StagedBody = std::function<bool(Requests&)>;

// Both run `body` on the copies on `stream` of `plane` and return what it
// returns (false: the results are not delivered, nothing is copied back).
bool RunLifted(DataPlane& plane, int stream, Requests& requests,
               const StagedBody& body);
bool RunStaged(DataPlane& plane, int stream, Requests& requests,
               const StagedBody& body);

}  // namespace perseus
