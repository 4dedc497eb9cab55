#include "cc/runtime/negotiation.h"

#include <algorithm>
#include <functional>
#include <sstream>
#include <tuple>

namespace perseus {
namespace {

// "rank 0 has X; ranks 1, 2 have Y" from one printable value per rank.
std::string DescribeByRank(const std::vector<std::string>& values,
                           const std::vector<int>& rank_ids) {
  std::vector<std::string> distinct;
  std::vector<std::vector<int>> ranks;
  for (size_t r = 0; r < values.size(); ++r) {
    size_t i = 0;
    while (i < distinct.size() && distinct[i] != values[r]) ++i;
    if (i == distinct.size()) {
      distinct.push_back(values[r]);
      ranks.emplace_back();
    }
    ranks[i].push_back(rank_ids[r]);
  }
  std::ostringstream out;
  for (size_t i = 0; i < distinct.size(); ++i) {
    if (i) out << "; ";
    out << (ranks[i].size() == 1 ? "rank " : "ranks ");
    for (size_t j = 0; j < ranks[i].size(); ++j) {
      if (j) out << ", ";
      out << ranks[i][j];
    }
    out << (ranks[i].size() == 1 ? " has " : " have ") << distinct[i];
  }
  return out.str();
}

template <typename F>
bool AllSame(const std::vector<TensorMeta>& metas, F key) {
  for (const TensorMeta& m : metas) {
    if (key(m) != key(metas[0])) return false;
  }
  return true;
}

template <typename F>
std::vector<std::string> Column(const std::vector<TensorMeta>& metas, F show) {
  std::vector<std::string> out;
  for (const TensorMeta& m : metas) out.push_back(show(m));
  return out;
}

std::vector<int64_t> TrailingDims(const TensorMeta& m) {
  if (m.shape.empty()) return {};
  return std::vector<int64_t>(m.shape.begin() + 1, m.shape.end());
}

}  // namespace

Negotiator::Negotiator(int size, int64_t fusion_threshold_bytes, std::vector<int> world_ranks,
                       std::function<int64_t(int64_t)> plan_bucket_bytes)
    : size_(size),
      world_(std::move(world_ranks)),
      fusion_threshold_(fusion_threshold_bytes),
      plan_bucket_bytes_(std::move(plan_bucket_bytes)),
      joined_(size, false),
      join_order_(size, 0) {
  if (world_.empty()) {
    for (int r = 0; r < size; ++r) world_.push_back(r);
  }
}

bool Negotiator::Complete(const Entry& e) const {
  if (e.count == 0) return false;
  for (int r = 0; r < size_; ++r) {
    if (!e.have[r] && !joined_[r]) return false;
  }
  return true;
}

void Negotiator::BeginCycle(int64_t now_ms, bool any_in_plan) {
  now_ms_ = std::max(now_ms_, now_ms);
  any_in_plan_ = any_in_plan;
}

bool Negotiator::Answered(const Entry& e) const {
  for (int r = 0; r < size_; ++r) {
    if (!e.have[r] && !joined_[r]) return false;
  }
  return true;
}

void Negotiator::Refuse(const Key& key, Entry& e, int rank, const TensorMeta& meta) {
  if (e.refusal.empty()) {
    e.refusal = "rank " + std::to_string(world_[rank]) + " refused its call: " + meta.rejected;
  }
  complete_.emplace(e.seq, key);  // fails the requests that have come
}

void Negotiator::Forget(std::map<Key, Entry>::iterator it) {
  const std::string name = it->first.first;
  std::vector<uint64_t>& calls = next_call_[name];
  calls.resize(size_, 0);
  for (uint64_t& c : calls) c = std::max(c, it->first.second + 1);
  table_.erase(it);
  auto open = table_.lower_bound(Key(name, 0));
  if ((open == table_.end() || open->first.first != name) &&
      std::all_of(calls.begin(), calls.end(), [&](uint64_t c) { return c == calls[0]; })) {
    next_call_.erase(name);
  }
}

void Negotiator::Add(int rank, const TensorMeta& meta) {
  ++adds_;
  std::vector<uint64_t>& calls = next_call_[meta.name];
  calls.resize(size_, 0);
  const Key key(meta.name, calls[rank]++);
  const bool refusal = meta.flags & kMetaRejected;
  if (refusal && (meta.flags & kMetaInFlightTwice) && key.second > 0) {
    // This rank refused a call that came while its previous call of the
    // name was in flight (two threads): that one fails on every rank too,
    // unless it has already run.
    auto previous = table_.find(Key(meta.name, key.second - 1));
    if (previous != table_.end() && previous->second.have[rank]) {
      Refuse(previous->first, previous->second, rank, meta);
    }
  }
  auto it = table_.find(key);
  if (it == table_.end()) {
    Entry e;
    e.seq = next_seq_++;
    e.first_ms = now_ms_;
    e.have.assign(size_, false);
    e.failed.assign(size_, false);
    e.metas.resize(size_);
    it = table_.emplace(key, std::move(e)).first;
  }
  Entry& e = it->second;
  e.have[rank] = true;
  e.metas[rank] = meta;
  ++e.count;
  if (refusal || !e.refusal.empty()) {
    Refuse(key, e, rank, meta);  // fails now, on every rank that asked
    return;
  }
  if (meta.op == OpType::kJoin && !joined_[rank]) {
    joined_[rank] = true;
    join_order_[rank] = adds_;
    // Whatever only this rank was missing can run now, with its input empty.
    for (const auto& kv : table_) {
      if (kv.second.refusal.empty() && Complete(kv.second)) complete_.emplace(kv.second.seq, kv.first);
    }
    return;
  }
  if (Complete(e)) complete_.emplace(e.seq, key);
}

Status Negotiator::Validate(const std::string& name, const Entry& e) const {
  if (!e.refusal.empty()) {
    int first = 0;
    while (!e.have[first]) ++first;
    return Status::Error(StatusCode::kInvalidArgument,
                         std::string("Perseus ") + OpTypeName(e.metas[first].op) +
                             " of tensor '" + name + "': " + e.refusal);
  }
  // Only the ranks that asked; joined ranks follow whatever they agreed.
  std::vector<TensorMeta> m;
  std::vector<int> ids;
  std::vector<int> joined_ids;
  for (int r = 0; r < size_; ++r) {
    if (e.have[r]) {
      m.push_back(e.metas[r]);
      ids.push_back(world_[r]);
    } else {
      joined_ids.push_back(world_[r]);
    }
  }
  auto fail = [&](const std::string& what, const std::vector<std::string>& by_rank) {
    std::ostringstream out;
    out << "Perseus " << OpTypeName(m[0].op) << " of tensor '" << name
        << "': ranks disagree on " << what << ": " << DescribeByRank(by_rank, ids);
    return Status::Error(StatusCode::kFailedPrecondition, out.str());
  };
  if (!joined_ids.empty()) {
    const OpType op = m[0].op;
    std::ostringstream who;
    for (size_t i = 0; i < joined_ids.size(); ++i) who << (i ? ", " : "") << joined_ids[i];
    if (op == OpType::kAlltoall) {
      return Status::Error(StatusCode::kFailedPrecondition,
                           "Perseus alltoall of tensor '" + name + "': rank(s) " + who.str() +
                               " have joined; alltoall cannot run while ranks are joined "
                               "(call it before join())");
    }
    if (op == OpType::kBroadcast && !e.have[m[0].root]) {
      return Status::Error(StatusCode::kFailedPrecondition,
                           "Perseus broadcast of tensor '" + name + "': the root rank " +
                               std::to_string(m[0].root) +
                               " has joined, so it has nothing to send; broadcast from a rank "
                               "that has not called join()");
    }
  }
  if (!AllSame(m, [](const TensorMeta& t) { return t.op; })) {
    return fail("the operation", Column(m, [](const TensorMeta& t) {
                  return std::string(OpTypeName(t.op));
                }));
  }
  if (!AllSame(m, [](const TensorMeta& t) { return t.group; })) {
    return fail("the number of tensors in the grouped call", Column(m, [](const TensorMeta& t) {
                  return t.group > 0 ? std::to_string(t.group) + " tensors"
                                     : std::string("not a grouped call");
                }));
  }
  if (!AllSame(m, [](const TensorMeta& t) { return t.dtype; })) {
    return fail("the dtype", Column(m, [](const TensorMeta& t) {
                  return std::string(DataTypeName(t.dtype));
                }));
  }
  const OpType op = m[0].op;
  auto shape_of = [](const TensorMeta& t) { return ShapeString(t.shape); };
  if (op == OpType::kAllreduce || op == OpType::kBroadcast ||
      op == OpType::kReducescatter) {
    if (!AllSame(m, [](const TensorMeta& t) { return t.shape; })) {
      return fail("the shape", Column(m, shape_of));
    }
  }
  if (op == OpType::kAllgather || op == OpType::kAlltoall) {
    if (!AllSame(m, [](const TensorMeta& t) { return t.shape.size(); }) ||
        !AllSame(m, TrailingDims) || m[0].shape.empty()) {
      return fail("the shape (all dimensions but the first must match)",
                  Column(m, shape_of));
    }
  }
  if (op == OpType::kAllreduce || op == OpType::kReducescatter) {
    if (!AllSame(m, [](const TensorMeta& t) { return t.reduce_op; })) {
      return fail("the reduction", Column(m, [](const TensorMeta& t) {
                    return std::string(ReduceOpName(t.reduce_op));
                  }));
    }
    if (!AllSame(m, [](const TensorMeta& t) {
          return std::make_tuple(t.prescale, t.postscale);
        })) {
      return fail("the prescale/postscale factors",
                  Column(m, [](const TensorMeta& t) {
                    std::ostringstream s;
                    s << "prescale " << t.prescale << ", postscale " << t.postscale;
                    return s.str();
                  }));
    }
  }
  if (op == OpType::kAllreduce &&
      !AllSame(m, [](const TensorMeta& t) { return t.compression; })) {
    return fail("compression", Column(m, [](const TensorMeta& t) {
                  return std::string(CompressionName(t.compression));
                }));
  }
  {
    std::vector<int> bad;
    for (size_t i = 0; i < m.size(); ++i) {
      if (m[i].flags & kMetaNonFinite) bad.push_back(ids[i]);
    }
    if (!bad.empty()) {
      std::ostringstream out;
      out << "Perseus " << OpTypeName(m[0].op) << " of tensor '" << name << "': rank";
      out << (bad.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < bad.size(); ++i) out << (i ? ", " : "") << bad[i];
      out << (bad.size() > 1 ? " have" : " has")
          << " NaN or Inf values in it (PERSEUS_ALLREDUCE_NANCHECK=1); the step is not "
             "applied on any rank";
      return Status::Error(StatusCode::kInvalidArgument, out.str());
    }
  }
  if (op == OpType::kBroadcast &&
      !AllSame(m, [](const TensorMeta& t) { return t.root; })) {
    return fail("the root rank", Column(m, [](const TensorMeta& t) {
                  return "root " + std::to_string(t.root);
                }));
  }
  if (op == OpType::kAlltoall) {
    for (size_t r = 0; r < m.size(); ++r) {
      if (!m[r].splits.empty() &&
          static_cast<int>(m[r].splits.size()) != size_) {
        return fail("splits (one entry per rank is needed)",
                    Column(m, [](const TensorMeta& t) {
                      return "splits " + ShapeString(t.splits);
                    }));
      }
    }
  }
  return Status::OK();
}

Response Negotiator::MakeResponse(const std::string& name, Entry&& e) const {
  int first = 0;
  while (!e.have[first]) ++first;
  Response resp;
  resp.op = e.metas[first].op;
  resp.names.push_back(name);
  resp.error = Validate(name, e);
  if (!resp.error.ok()) {
    resp.siblings_run = true;
    for (int r = 0; r < size_; ++r) {
      if (!e.have[r] || e.metas[r].group <= 0 || e.metas[r].group != e.metas[first].group ||
          e.metas[r].op == OpType::kJoin) {
        resp.siblings_run = false;
      }
    }
  }
  if (resp.error.ok()) {
    if (resp.op == OpType::kAllgather) {
      std::vector<int64_t> dims;
      for (int r = 0; r < size_; ++r) dims.push_back(e.have[r] ? e.metas[r].shape[0] : 0);
      resp.first_dims.push_back(std::move(dims));
    } else if (resp.op == OpType::kAlltoall) {
      for (const TensorMeta& m : e.metas) {
        std::vector<int64_t> s = m.splits;
        if (s.empty()) {
          // No splits: the first dimension is divided evenly; the sender
          // checked divisibility before enqueueing.
          s.assign(size_, m.shape[0] / size_);
        }
        resp.splits.push_back(std::move(s));
      }
    }
  }
  // On a device only where every rank that submitted it has it there.
  bool on_device = true;
  for (int r = 0; r < size_; ++r) {
    if (e.have[r] && !(e.metas[r].flags & kMetaOnDevice)) on_device = false;
  }
  resp.metas.push_back(std::move(e.metas[first]));
  if (on_device) {
    resp.metas.back().flags |= kMetaOnDevice;
  } else {
    resp.metas.back().flags &= ~kMetaOnDevice;
  }
  return resp;
}

bool Negotiator::TakeRefusedFailure(const std::string& name, Entry& e, Response* out) {
  std::vector<bool> fail(size_, false);
  bool any = false;
  for (int r = 0; r < size_; ++r) {
    fail[r] = e.have[r] && !(e.metas[r].flags & kMetaRejected) && !e.failed[r];
    any |= fail[r];
    e.failed[r] = e.failed[r] || fail[r];
  }
  if (!any) return false;
  int first = 0;
  while (!e.have[first]) ++first;
  out->op = e.metas[first].op;
  out->names = {name};
  out->metas = {e.metas[first]};
  out->metas[0].flags &= ~kMetaOnDevice;
  out->error = Validate(name, e);
  // Only these ranks fail their request of the name: a rank that refused
  // the call, or whose request failed before, may have its next call pending.
  out->real_request = std::move(fail);
  return true;
}

std::map<uint64_t, Negotiator::Key> Negotiator::WaitingSince(int64_t age_ms) const {
  std::map<uint64_t, Key> out;
  for (const auto& kv : table_) {
    if (!kv.second.refusal.empty()) continue;
    // Waiting in join() for ranks with more data is not a stall.
    bool join = false;
    for (int r = 0; r < size_; ++r) join |= kv.second.have[r] && kv.second.metas[r].op == OpType::kJoin;
    if (!join && now_ms_ - kv.second.first_ms >= age_ms) out.emplace(kv.second.seq, kv.first);
  }
  return out;
}

std::string Negotiator::WhoAsked(const Entry& e) const {
  std::vector<int> missing, present;
  for (int r = 0; r < size_; ++r) (e.have[r] ? present : missing).push_back(world_[r]);
  auto list = [](const std::vector<int>& ranks) {
    std::ostringstream out;
    out << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
    return out.str();
  };
  return list(present) + (present.size() == 1 ? " has" : " have") + " submitted it; " +
         list(missing) + (missing.size() == 1 ? " has" : " have") + " not";
}

std::vector<std::string> Negotiator::StallReport(int64_t check_ms) {
  std::vector<std::string> out;
  if (check_ms <= 0) return out;
  for (const auto& kv : WaitingSince(check_ms)) {
    Entry& e = table_[kv.second];
    if (e.reported_ms && now_ms_ - e.reported_ms < check_ms) continue;
    e.reported_ms = now_ms_;
    int first = 0;
    while (!e.have[first]) ++first;
    std::ostringstream line;
    line << OpTypeName(e.metas[first].op) << " '" << kv.second.first << "' waiting "
         << (now_ms_ - e.first_ms) / 1000 << " s: " << WhoAsked(e);
    out.push_back(line.str());
  }
  return out;
}

std::vector<Response> Negotiator::TakeStalled(int64_t timeout_ms) {
  std::vector<Response> out;
  if (timeout_ms <= 0) return out;
  for (const auto& kv : WaitingSince(timeout_ms)) {
    auto it = table_.find(kv.second);
    const Entry& e = it->second;
    const std::string& name = kv.second.first;
    std::ostringstream msg;
    std::vector<int> present;
    for (int r = 0; r < size_; ++r) {
      if (e.have[r]) present.push_back(r);
    }
    msg << "Perseus " << OpTypeName(e.metas[present[0]].op) << " of tensor '" << name
        << "' stalled for " << (now_ms_ - e.first_ms) / 1000 << " s: " << WhoAsked(e)
        << " (PERSEUS_STALL_TIMEOUT_SECONDS=" << timeout_ms / 1000.0
        << "); the ranks are running different collectives: check that every rank makes the "
           "same calls, or raise PERSEUS_STALL_TIMEOUT_SECONDS if a rank is legitimately busy";
    Response resp;
    resp.op = e.metas[present[0]].op;
    resp.names.push_back(name);
    resp.metas.push_back(e.metas[present[0]]);
    resp.error = Status::Error(StatusCode::kFailedPrecondition, msg.str());
    out.push_back(std::move(resp));
    complete_.erase(e.seq);
    Forget(it);
  }
  return out;
}

std::vector<Response> Negotiator::TakeReady() {
  std::vector<Response> ready;
  for (auto& kv : complete_) {
    auto it = table_.find(kv.second);
    if (it == table_.end()) continue;  // refused and over, from an earlier listing
    const std::string& name = kv.second.first;
    if (!it->second.refusal.empty()) {
      Response failed;
      if (TakeRefusedFailure(name, it->second, &failed)) ready.push_back(std::move(failed));
      if (Answered(it->second)) Forget(it);
      continue;
    }
    Response r = MakeResponse(name, std::move(it->second));
    Forget(it);
    if (r.op == OpType::kJoin) {
      // Every rank has joined: report the last one to join and start over,
      // so join() can be used once per epoch.
      int last = 0;
      for (int q = 1; q < size_; ++q) {
        if (join_order_[q] >= join_order_[last]) last = q;
      }
      r.metas[0].root = last;
      joined_.assign(size_, false);
    }
    ready.push_back(std::move(r));
  }
  complete_.clear();
  learner_.Watch(ready);
  learner_.EndCycle(any_in_plan_, [this] { return PlannableInTable(); });
  return Fuse(std::move(ready), fusion_threshold_);
}

bool Negotiator::PlannableInTable() const {
  for (const auto& kv : table_) {
    for (int r = 0; r < size_; ++r) {
      if (kv.second.have[r] && (kv.second.metas[r].flags & kMetaPlannable)) return true;
    }
  }
  return false;
}

Plan Negotiator::TakePlan() {
  Plan plan = learner_.Build(
      [this](std::vector<Response> run, int64_t threshold) {
        return Fuse(std::move(run), threshold < 0 ? fusion_threshold_ : threshold);
      },
      [this](int64_t step_bytes) {
        return plan_bucket_bytes_ ? plan_bucket_bytes_(step_bytes) : -1;
      });
  // Plannable entries still being negotiated are dropped on every rank alike.
  for (auto it = table_.begin(); it != table_.end();) {
    bool plannable = false;
    for (int r = 0; r < size_; ++r) {
      plannable |= it->second.have[r] && (it->second.metas[r].flags & kMetaPlannable);
    }
    if (plannable) {
      auto over = it++;
      Forget(over);  // every rank runs this call from the plan
    } else {
      ++it;
    }
  }
  return plan;
}

std::vector<Response> Negotiator::Fuse(std::vector<Response> ready, int64_t threshold) const {
  // Allreduces with the same dtype, reduction and scale factors share a
  // bucket until it would exceed the threshold; everything else passes
  // through in order. A bucket takes the position of its first member.
  std::vector<Response> out;
  std::map<std::tuple<int, int, double, double, int>, size_t> open;  // key -> index in out
  std::vector<int64_t> bucket_bytes;
  for (Response& r : ready) {
    // Top-k runs tensor by tensor (each has its own selection).
    bool fusable = r.op == OpType::kAllreduce && r.error.ok() && threshold > 0 &&
                   r.metas[0].compression != kCompressTopk;
    if (!fusable) {
      out.push_back(std::move(r));
      bucket_bytes.push_back(0);
      continue;
    }
    const TensorMeta& m = r.metas[0];
    int64_t bytes = NumElements(m.shape) * static_cast<int64_t>(DataTypeSize(m.dtype));
    auto key = std::make_tuple(static_cast<int>(m.dtype),
                               static_cast<int>(m.reduce_op), m.prescale,
                               m.postscale, static_cast<int>(m.compression));
    auto it = open.find(key);
    if (it != open.end() &&
        bucket_bytes[it->second] + bytes <= threshold) {
      Response& b = out[it->second];
      b.names.push_back(r.names[0]);
      b.metas.push_back(std::move(r.metas[0]));
      bucket_bytes[it->second] += bytes;
      continue;
    }
    open[key] = out.size();
    out.push_back(std::move(r));
    bucket_bytes.push_back(bytes);
  }
  return out;
}

std::string Negotiator::DescribePending() const {
  std::ostringstream out;
  int shown = 0;
  for (const auto& kv : table_) {
    if (shown++ == 5) {
      out << " ...";
      break;
    }
    out << (shown > 1 ? "; " : "") << "'" << kv.first.first << "' waiting for rank(s)";
    for (int r = 0; r < size_; ++r) {
      if (!kv.second.have[r]) out << " " << r;
    }
  }
  return out.str();
}

}  // namespace perseus
