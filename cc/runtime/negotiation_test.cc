#include "cc/runtime/negotiation.h"

#include <string>
#include <vector>

#include "cc/runtime/message.h"
#include "cc/testing/check.h"

using namespace perseus;

namespace {

TensorMeta Meta(const std::string& name, std::vector<int64_t> shape,
                DataType dtype = DataType::kFloat32, int32_t flags = 0) {
  TensorMeta m;
  m.name = name;
  m.shape = std::move(shape);
  m.dtype = dtype;
  m.flags = flags;
  return m;
}

// One cycle in which every rank submits `metas`.
std::vector<Response> Cycle(Negotiator& n, int ranks, const std::vector<TensorMeta>& metas,
                            int64_t now_ms = 0) {
  n.BeginCycle(now_ms, false);
  for (int r = 0; r < ranks; ++r) {
    for (const TensorMeta& m : metas) n.Add(r, m);
  }
  return n.TakeReady();
}

}  // namespace

TEST(ReadyOnlyWhenEveryRankAsked) {
  Negotiator n(3, 0);
  n.BeginCycle(0, false);
  n.Add(0, Meta("a", {4}));
  n.Add(1, Meta("a", {4}));
  CHECK(n.TakeReady().empty());
  CHECK(n.HasPending());
  n.BeginCycle(1, false);
  n.Add(2, Meta("a", {4}));
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK_EQ(ready[0].names[0], std::string("a"));
  CHECK(ready[0].error.ok());
  CHECK(!n.HasPending());
}

TEST(ReadyInTheOrderNamesFirstAppeared) {
  Negotiator n(2, 0);  // no fusion
  n.BeginCycle(0, false);
  n.Add(0, Meta("b", {1}));
  n.Add(0, Meta("a", {1}));
  n.Add(1, Meta("a", {1}));
  n.Add(1, Meta("b", {1}));
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 2u);
  CHECK_EQ(ready[0].names[0], std::string("b"));
  CHECK_EQ(ready[1].names[0], std::string("a"));
}

TEST(DisagreeingShapesBecomeAnErrorNamingTheRanks) {
  Negotiator n(2, 1 << 20);
  n.BeginCycle(0, false);
  n.Add(0, Meta("w", {4}));
  n.Add(1, Meta("w", {5}));
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(!ready[0].error.ok());
  CHECK(ready[0].error.code == StatusCode::kFailedPrecondition);
  const std::string& msg = ready[0].error.message;
  CHECK(msg.find("'w'") != std::string::npos);
  CHECK(msg.find("shape") != std::string::npos);
  CHECK(msg.find("[4]") != std::string::npos && msg.find("[5]") != std::string::npos);
}

TEST(FusionUpToTheThresholdAndOneDtypePerBucket) {
  Negotiator n(2, 64);  // 64 bytes: 16 float32
  std::vector<Response> ready =
      Cycle(n, 2, {Meta("a", {8}), Meta("b", {8}), Meta("c", {8}), Meta("i", {2}, DataType::kInt32)});
  // a+b fill one bucket (64 bytes); c starts another; the int32 tensor is
  // apart. A bucket keeps the place of its first member.
  CHECK_EQ(ready.size(), 3u);
  CHECK_EQ(ready[0].names.size(), 2u);
  CHECK_EQ(ready[0].names[1], std::string("b"));
  CHECK_EQ(ready[1].names[0], std::string("c"));
  CHECK_EQ(ready[2].names[0], std::string("i"));
  std::vector<Response> more = Cycle(n, 2, {Meta("x", {4}), Meta("y", {4})});
  CHECK_EQ(more.size(), 1u);  // small ones share one bucket
}

TEST(StallTimeoutNamesWhoAskedAndWhoDidNot) {
  Negotiator n(3, 0);
  n.BeginCycle(1000, false);
  n.Add(0, Meta("late", {1}));
  n.Add(2, Meta("late", {1}));
  n.TakeReady();
  n.BeginCycle(1500, false);
  CHECK(n.TakeStalled(2000).empty());  // not yet
  n.BeginCycle(3500, false);
  CHECK(!n.StallReport(2000).empty());
  std::vector<Response> stalled = n.TakeStalled(2000);
  CHECK_EQ(stalled.size(), 1u);
  const std::string& msg = stalled[0].error.message;
  CHECK(msg.find("'late'") != std::string::npos);
  CHECK(msg.find("rank 1") != std::string::npos);
  CHECK(msg.find("PERSEUS_STALL_TIMEOUT_SECONDS") != std::string::npos);
  CHECK(!n.HasPending());
}

TEST(PlanLearnedFromRepeatedStepsHoldsOnlyTensorsOfOneCycle) {
  Negotiator n(2, 1 << 20);
  const std::vector<TensorMeta> group_a = {Meta("a0", {4}, DataType::kFloat32, kMetaPlannable),
                                           Meta("a1", {4}, DataType::kFloat32, kMetaPlannable)};
  const std::vector<TensorMeta> group_b = {Meta("b0", {4}, DataType::kFloat32, kMetaPlannable)};
  int steps = 0;
  while (!n.PlanReady() && steps < 10) {
    Cycle(n, 2, group_a);  // each step's two groups complete in two cycles
    Cycle(n, 2, group_b);
    ++steps;
  }
  CHECK(n.PlanReady());
  CHECK(steps <= 3);
  Plan plan = n.TakePlan();
  CHECK_EQ(plan.buckets.size(), 2u);  // never one bucket across the two cycles
  CHECK_EQ(plan.metas.size(), 3u);
  CHECK_EQ(plan.bucket_of.at("a1"), 0u);
  CHECK_EQ(plan.bucket_of.at("b0"), 1u);
}

TEST(LearningThatBeganInsideAStepStartsAgainAndFindsABoundary) {
  // Each step completes as {x, y} then {z}, but learning begins at {y}:
  // the recorded step (y, z, x) never ends at a cycle's end.
  Negotiator n(2, 1 << 20);
  auto m = [](const char* name) { return Meta(name, {4}, DataType::kFloat32, kMetaPlannable); };
  Cycle(n, 2, {m("y")});
  Cycle(n, 2, {m("z")});
  int steps = 0;
  while (!n.PlanReady() && steps < 10) {
    Cycle(n, 2, {m("x"), m("y")});
    if (n.PlanReady()) break;
    Cycle(n, 2, {m("z")});
    ++steps;
  }
  CHECK(n.PlanReady());
  CHECK(steps <= 4);
  Plan plan = n.TakePlan();
  CHECK_EQ(plan.buckets.size(), 2u);
  CHECK_EQ(plan.bucket_of.at("x"), plan.bucket_of.at("y"));  // one cycle, one bucket
  CHECK(plan.bucket_of.at("z") != plan.bucket_of.at("x"));
}

TEST(AChangedStepIsNotPlanned) {
  Negotiator n(2, 1 << 20);
  for (int step = 0; step < 6; ++step) {
    Cycle(n, 2, {Meta("g", {4 + step}, DataType::kFloat32, kMetaPlannable)});
  }
  CHECK(!n.PlanReady());
}

TEST(MatchesPlanComparesWhatTheBucketDependsOn) {
  TensorMeta a = Meta("t", {2, 3}, DataType::kFloat32, kMetaPlannable);
  CHECK(MatchesPlan(a, a));
  TensorMeta b = a;
  b.shape = {3, 2};
  CHECK(!MatchesPlan(a, b));
  b = a;
  b.dtype = DataType::kFloat64;
  CHECK(!MatchesPlan(a, b));
}

TEST(CycleMessagesRoundTrip) {
  CycleMessage msg;
  msg.shutdown = true;
  for (int i = 0; i < 100; ++i) {
    TensorMeta m = Meta("tensor/" + std::to_string(i), {}, DataType::kFloat16);
    if (i % 3) m.shape = {i, 2, 0};
    m.op = i % 2 ? OpType::kAllgather : OpType::kAlltoall;
    m.reduce_op = ReduceOp::kMax;
    m.root = i % 4;
    m.prescale = 0.5 + i;
    m.postscale = 1.0 / (i + 1);
    m.splits = {i, 0, 1};
    m.group = i;
    m.compression = kCompressTopk;
    m.flags = kMetaPlannable | kMetaNonFinite;
    msg.requests.push_back(m);
  }
  std::vector<char> bytes = EncodeCycle(msg);
  CycleMessage back = DecodeCycle(bytes.data(), bytes.size());
  CHECK(back.shutdown);
  CHECK_EQ(back.requests.size(), msg.requests.size());
  for (size_t i = 0; i < back.requests.size() && i < msg.requests.size(); ++i) {
    const TensorMeta &x = back.requests[i], &y = msg.requests[i];
    CHECK(x.name == y.name && x.op == y.op && x.dtype == y.dtype && x.reduce_op == y.reduce_op &&
          x.shape == y.shape && x.root == y.root && x.prescale == y.prescale &&
          x.postscale == y.postscale && x.splits == y.splits && x.group == y.group &&
          x.compression == y.compression && x.flags == y.flags);
  }
  CycleMessage empty = DecodeCycle(EncodeCycle(CycleMessage()).data(),
                                   EncodeCycle(CycleMessage()).size());
  CHECK(!empty.shutdown && empty.requests.empty());
}

TEST(TruncatedCycleMessagesAreRejected) {
  CycleMessage msg;
  msg.requests.push_back(Meta("some/tensor", {3, 4}));
  std::vector<char> bytes = EncodeCycle(msg);
  for (size_t cut = 1; cut < bytes.size(); cut += 3) {
    CHECK_THROWS(DecodeCycle(bytes.data(), bytes.size() - cut));
  }
}

namespace {
TensorMeta Refused(const std::string& name) {
  TensorMeta m = Meta(name, {}, DataType::kFloat32, kMetaRejected);
  m.rejected = "allgather needs at least one dimension";
  return m;
}

// A call refused because the rank's previous call of the name was in flight.
TensorMeta Twice(const std::string& name) {
  TensorMeta m = Meta(name, {}, DataType::kFloat32, kMetaRejected | kMetaInFlightTwice);
  m.rejected = "two calls of this name were in flight at once";
  return m;
}
}  // namespace

TEST(ARefusalFromARankThatAlreadyAskedFailsTheNameOnEveryRank) {
  // Rank 0 asked for "x", then refused its next call of "x" (it came while
  // the first was in flight: two threads). The first call fails, with rank
  // 0's reason, though rank 1 has not asked; rank 1's first call fails as it
  // comes, its second pairs with rank 0's refused second (and fails), and
  // the third calls pair and run: every rank's calls of the name stay in
  // step.
  Negotiator n(2, 0);
  n.BeginCycle(0, false);
  n.Add(0, Meta("x", {4}));
  TensorMeta twice = Twice("x");
  twice.rejected = "two calls of this name were in flight at once on rank 0";
  n.Add(0, twice);
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(!ready[0].error.ok());
  CHECK(ready[0].error.message.find("rank 0 refused its call: two calls") != std::string::npos);
  CHECK(ready[0].real_request[0] && !ready[0].real_request[1]);
  for (int call = 1; call <= 2; ++call) {  // rank 1's first and second calls
    n.BeginCycle(call, false);
    n.Add(1, Meta("x", {4}));
    ready = n.TakeReady();
    CHECK_EQ(ready.size(), 1u);
    CHECK(!ready[0].error.ok() && ready[0].real_request[1] && !ready[0].real_request[0]);
  }
  n.BeginCycle(3, false);
  n.Add(0, Meta("x", {4}));
  n.Add(1, Meta("x", {4}));
  ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].error.ok());
}

TEST(BothRanksRefusingTheirSecondCallsKeepTheirCallsInStep) {
  // Each rank's two threads called "x" at once and each rank refused one:
  // the first calls fail, the refusals pair with each other (nothing real
  // to fail: no response), the next calls run.
  Negotiator n(2, 0);
  n.BeginCycle(0, false);
  for (int r = 0; r < 2; ++r) {
    n.Add(r, Meta("x", {4}));
    n.Add(r, Twice("x"));
  }
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(!ready[0].error.ok() && ready[0].real_request[0] && ready[0].real_request[1]);
  CHECK(!n.HasPending());
  n.BeginCycle(2, false);
  n.Add(1, Meta("x", {4}));
  n.Add(0, Meta("x", {4}));
  ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].error.ok());
}

TEST(ARefusalArrivingAfterOtherRanksAskedCountsTheirAnswers) {
  // The window of two threads: a rank whose first call of "x" completed
  // before its second came sends that second call as usual, while a rank
  // where the two overlapped refuses its second. When the refusal arrives
  // after the others' calls, those calls are their answers to the refused
  // call: they fail with it, and their next calls pair with the refusing
  // rank's next call. (Before, they were not counted as answered: each
  // such rank's next call failed too, and the refusing rank's next call
  // waited for an answer already given, so the ranks fell out of step.)
  for (int refuser : {0, 1, 2}) {
    Negotiator n(3, 0);
    CHECK_EQ(Cycle(n, 3, {Meta("x", {4})}).size(), 1u);  // the first calls ran
    n.BeginCycle(1, false);
    for (int r = 0; r < 3; ++r) {
      if (r != refuser) n.Add(r, Meta("x", {4}));
    }
    n.Add(refuser, Twice("x"));
    std::vector<Response> ready = n.TakeReady();
    CHECK_EQ(ready.size(), 1u);
    CHECK(!ready[0].error.ok());
    for (int r = 0; r < 3; ++r) CHECK_EQ(ready[0].real_request[r], r != refuser);
    CHECK(!n.HasPending());
    for (int round = 0; round < 3; ++round) {
      ready = Cycle(n, 3, {Meta("x", {4})}, 2 + round);
      CHECK_EQ(ready.size(), 1u);
      CHECK(ready[0].error.ok());
    }
  }
  // One rank's answer comes after the refusal: it fails as it comes, and
  // then every rank's next call pairs.
  Negotiator n(3, 0);
  CHECK_EQ(Cycle(n, 3, {Meta("x", {4})}).size(), 1u);
  n.BeginCycle(1, false);
  n.Add(0, Meta("x", {4}));
  n.Add(2, Twice("x"));
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].real_request == std::vector<bool>({true, false, false}));
  n.BeginCycle(2, false);
  n.Add(1, Meta("x", {4}));  // rank 1's answer
  n.Add(0, Meta("x", {4}));  // rank 0's next call
  n.Add(2, Meta("x", {4}));  // rank 2's next call
  ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(!ready[0].error.ok() && ready[0].real_request == std::vector<bool>({false, true, false}));
  CHECK(n.HasPending());
  n.BeginCycle(3, false);
  n.Add(1, Meta("x", {4}));
  ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].error.ok());
}

TEST(ANextCallOfARefusedNameWaitsForEveryRanksAnswerToTheRefusedOne) {
  for (int mover : {0, 1}) {
    const int slow = 1 - mover;
    Negotiator n(2, 0);
    n.BeginCycle(0, false);
    n.Add(mover, Refused("g"));  // refused locally: this rank moves on
    CHECK(n.TakeReady().empty());  // no rank has a request of it to fail
    // One cycle brings the other rank's refusal of the same call and the
    // mover's next call of the name (eager calls share a default name), in
    // rank order: they must not be paired. Nobody made the refused call
    // with a real request: no rank fails what it has pending under the
    // name (the mover's next call).
    n.BeginCycle(1, false);
    for (int r = 0; r < 2; ++r) n.Add(r, r == mover ? Meta("g", {1, 2}) : Refused("g"));
    CHECK(n.TakeReady().empty());
    CHECK(n.HasPending());  // the mover's next call, now negotiating
    n.BeginCycle(2, false);
    n.Add(slow, Meta("g", {1, 2}));
    std::vector<Response> third = n.TakeReady();
    CHECK_EQ(third.size(), 1u);
    CHECK(third[0].error.ok());
    CHECK(third[0].metas[0].shape == std::vector<int64_t>({1, 2}));
  }
}

TEST(AJoinedRankSkipsTheCallsItStoodInForAndPairsAfterwards) {
  // Rank 2 joins; ranks 0 and 1 call "x" twice more (rank 2 stands in),
  // then join; afterwards every rank's next call of "x" pairs.
  Negotiator n(3, 0);
  CHECK_EQ(Cycle(n, 3, {Meta("x", {2})}).size(), 1u);
  TensorMeta join = Meta("join", {});
  join.op = OpType::kJoin;
  n.BeginCycle(1, false);
  n.Add(2, join);
  CHECK(n.TakeReady().empty());
  for (int call = 0; call < 2; ++call) {
    n.BeginCycle(2 + call, false);
    n.Add(0, Meta("x", {2}));
    n.Add(1, Meta("x", {2}));
    std::vector<Response> ready = n.TakeReady();
    CHECK_EQ(ready.size(), 1u);
    CHECK(ready[0].error.ok() && ready[0].op == OpType::kAllreduce);
  }
  n.BeginCycle(4, false);
  n.Add(0, join);
  n.Add(1, join);
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].op == OpType::kJoin);
  ready = Cycle(n, 3, {Meta("x", {2})}, 5);
  CHECK_EQ(ready.size(), 1u);
  CHECK(ready[0].error.ok());
  CHECK(!n.HasPending());
  CHECK_EQ(n.NamesTracked(), 0u);
}

TEST(CallNumbersAreKeptOnlyForNamesInFlight) {
  Negotiator n(2, 0);
  for (int i = 0; i < 1000; ++i) {
    CHECK_EQ(Cycle(n, 2, {Meta("step" + std::to_string(i), {1})}, i).size(), 1u);
  }
  CHECK_EQ(n.NamesTracked(), 0u);
  n.BeginCycle(1000, false);
  n.Add(0, Meta("open", {1}));
  CHECK(n.TakeReady().empty());
  CHECK_EQ(n.NamesTracked(), 1u);
  // A stall timeout ends the call; the rank that never made it skips it.
  n.BeginCycle(5000, false);
  CHECK_EQ(n.TakeStalled(1000).size(), 1u);
  CHECK_EQ(n.NamesTracked(), 0u);
  CHECK_EQ(Cycle(n, 2, {Meta("open", {1})}, 5001).size(), 1u);
}

TEST(ACallHeldBackByARefusalNobodyAnswersStallsNamingTheRank) {
  Negotiator n(2, 0);
  n.BeginCycle(0, false);
  n.Add(1, Refused("g"));
  CHECK(n.TakeReady().empty());
  n.BeginCycle(10, false);
  n.Add(1, Meta("g", {3}));
  CHECK(n.TakeReady().empty());
  n.BeginCycle(5000, false);
  CHECK(n.TakeStalled(10000).empty());
  n.BeginCycle(20000, false);
  std::vector<Response> stalled = n.TakeStalled(10000);
  CHECK_EQ(stalled.size(), 1u);
  CHECK(stalled[0].error.message.find("rank 1 has submitted it; rank 0 has not") !=
        std::string::npos);
  CHECK(stalled[0].error.message.find("'g'") != std::string::npos);
}

TEST(AResponseIsOnADeviceOnlyWhereEveryRankHasItThere) {
  Negotiator n(3, 0);  // no fusion
  n.BeginCycle(0, false);
  for (int r = 0; r < 3; ++r) {
    n.Add(r, Meta("device", {4}, DataType::kFloat32, kMetaOnDevice));
    // Rank 1 has this one in host memory: NCCL must carry it on no rank.
    n.Add(r, Meta("mixed", {4}, DataType::kFloat32, r == 1 ? 0 : kMetaOnDevice));
    n.Add(r, Meta("host", {4}));
  }
  std::vector<Response> ready = n.TakeReady();
  CHECK_EQ(ready.size(), 3u);
  for (const Response& r : ready) {
    CHECK(r.error.ok());
    const bool on_device = (r.metas[0].flags & kMetaOnDevice) != 0;
    CHECK(on_device == (r.names[0] == "device"));
  }
}
