// The plan check (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS): the ranks compare
// digests of their copies of an offline plan before a plan step, and fail
// naming the first tensor where they differ (plan_check.cc explains why).
#pragma once

#include <cstdint>
#include <memory>

#include "cc/core/timeline.h"
#include "cc/runtime/negotiation.h"
#include "cc/runtime/options.h"

namespace perseus {

// This rank's digest of `plan` before plan step `step`.
std::shared_ptr<PlanDigest> DigestPlan(const Plan& plan, int64_t step);

// Compares `mine` with every rank's through `allreduce` (collective: every
// rank calls it before the same step). Throws, naming the ranks and what
// each holds at the first position where the plans differ.
void CheckPlans(const PlanDigest& mine, const BufferAllreduce& allreduce,
                const Topology& ranks, int check_n_steps, Timeline& timeline);

}  // namespace perseus
