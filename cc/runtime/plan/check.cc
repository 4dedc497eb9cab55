// The plan check (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS).
#include "cc/runtime/plan/plan.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {
// ---- Plan check (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS) ------------------------
//
// The votes catch a rank whose requests do not fit its plan; they cannot
// catch ranks whose plans differ (the same tensors packed in another order
// or other buckets would be summed with the wrong elements, silently). So
// when a plan is entered, and then every N plan steps, every rank compares
// a digest of its copy of the plan before the step's first bucket: one
// allreduce of four integers. On a difference, two more find the first
// position where the plans differ and gather each rank's tensor there, and
// every rank fails naming them.

namespace {
template <typename T>
uint64_t FnvValue(uint64_t h, const T& v) {
  return Fnv1a(&v, sizeof(v), h);
}
constexpr size_t kPlanCheckText = 240;  // bytes per rank describing its tensor
}  // namespace

std::shared_ptr<PlanDigest> DigestPlan(const Plan& plan, int64_t step) {
  auto digest = std::make_shared<PlanDigest>();
  digest->step = step;
  std::vector<int64_t>& digests = digest->digests;
  std::vector<std::string>& described = digest->described;
  // One digest per position of the plan (bucket by bucket, in order): the
  // tensor's name and everything MatchesPlan compares, and its bucket.
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const Response& r = plan.buckets[b];
    for (size_t i = 0; i < r.names.size(); ++i) {
      const TensorMeta& m = r.metas[i];
      uint64_t h = Fnv1a(r.names[i].data(), r.names[i].size());
      h = FnvValue(h, b);
      h = FnvValue(h, static_cast<int32_t>(m.op));
      h = FnvValue(h, static_cast<int32_t>(m.dtype));
      h = FnvValue(h, static_cast<int32_t>(m.reduce_op));
      h = FnvValue(h, m.group);
      h = FnvValue(h, m.compression);
      h = FnvValue(h, m.prescale);
      h = FnvValue(h, m.postscale);
      for (int64_t d : m.shape) h = FnvValue(h, d);
      digests.push_back(static_cast<int64_t>((h >> 2) | 1));  // in [1, 2^62): negation is safe
      described.push_back("'" + r.names[i] + "' (" + DataTypeName(m.dtype) + " " +
                          ShapeString(m.shape) + ") in bucket " + std::to_string(b));
    }
  }
  return digest;
}

void CheckPlans(const PlanDigest& plan, const BufferAllreduce& allreduce,
                const Topology& ranks, int check_n_steps, Timeline& timeline) {
  TimelineSpan span(timeline, 1, "plan check", "negotiation");
  const int64_t step = plan.step;
  const std::vector<int64_t>& digests = plan.digests;
  const std::vector<std::string>& described = plan.described;
  const uint64_t whole = Fnv1a(digests.data(), digests.size() * sizeof(int64_t));
  const int64_t all = static_cast<int64_t>((whole >> 2) | 1);
  const int64_t count = static_cast<int64_t>(digests.size());
  const ReduceOp min64 = ReduceOp::kMin;
  // Minimum of x and of -x: the smallest and (negated) largest value.
  std::vector<int64_t> head{all, -all, count, -count};
  allreduce(head.data(), head.size(), DataType::kInt64, min64);
  if (head[0] == -head[1] && head[2] == -head[3]) return;

  const int64_t longest = -head[3];
  std::vector<int64_t> at(2 * static_cast<size_t>(longest), 0);
  for (int64_t i = 0; i < longest; ++i) {
    const int64_t d = i < count ? digests[i] : 0;  // 0: no tensor at this position
    at[i] = d;
    at[longest + i] = -d;
  }
  allreduce(at.data(), at.size(), DataType::kInt64, min64);
  int64_t pos = -1;
  for (int64_t i = 0; i < longest && pos < 0; ++i) {
    if (at[i] != -at[longest + i]) pos = i;
  }
  // Each rank's description of its tensor at that position, in its own slot
  // (the others are zero, so the sum is the text).
  std::vector<uint8_t> text(kPlanCheckText * ranks.size, 0);
  std::string mine = pos < 0 ? "a plan of " + std::to_string(count) + " tensors"
                     : pos < count ? described[pos]
                                   : "no tensor (its plan has " + std::to_string(count) + ")";
  mine.resize(std::min(mine.size(), kPlanCheckText - 1));
  std::memcpy(text.data() + kPlanCheckText * ranks.rank, mine.data(), mine.size());
  allreduce(text.data(), text.size(), DataType::kUint8, ReduceOp::kSum);
  // Ranks grouped by what they hold, in order of first appearance.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < ranks.size; ++r) {
    const char* t = reinterpret_cast<const char*>(text.data() + kPlanCheckText * r);
    std::string what(t, strnlen(t, kPlanCheckText));
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == what; });
    if (it == groups.end()) {
      groups.push_back({what, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(WorldRankOf(ranks, r));
  }
  std::ostringstream msg;
  msg << "offline plan check before plan step " << step
      << " (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS=" << check_n_steps
      << "): the ranks hold different plans";
  if (pos >= 0) msg << "; at position " << pos << " (bucket order)";
  msg << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    msg << (g ? "; " : "") << RankList(groups[g].second)
        << (groups[g].second.size() == 1 ? " has " : " have ") << groups[g].first;
  }
  msg << ". Their gradients would be summed with another tensor's elements";
  throw std::runtime_error(msg.str());
}

}  // namespace perseus
