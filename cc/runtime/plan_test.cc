#include "cc/runtime/plan.h"

#include "cc/runtime/fusion.h"
#include "cc/testing/check.h"

using namespace perseus;

namespace {

TensorMeta Meta(const std::string& name, int64_t n) {
  TensorMeta m;
  m.name = name;
  m.shape = {n};
  m.flags = kMetaPlannable;
  return m;
}

// Two buckets: {a, b} then {c}.
Plan TwoBuckets() {
  Plan p;
  Response first, second;
  first.names = {"a", "b"};
  first.metas = {Meta("a", 2), Meta("b", 3)};
  second.names = {"c"};
  second.metas = {Meta("c", 4)};
  p.buckets = {first, second};
  for (size_t b = 0; b < p.buckets.size(); ++b) {
    for (size_t i = 0; i < p.buckets[b].names.size(); ++i) {
      p.metas[p.buckets[b].names[i]] = p.buckets[b].metas[i];
      p.bucket_of[p.buckets[b].names[i]] = b;
    }
  }
  return p;
}

}  // namespace

TEST(ABucketIsDispatchedOnceAllItsTensorsArrived) {
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  CHECK(plan.active());
  bool completes = true;
  CHECK(plan.Arrive(Meta("a", 2), &completes));
  CHECK(!completes);
  CHECK(!plan.CanDispatch(false));
  CHECK(plan.Arrive(Meta("b", 3), &completes));
  CHECK(completes);
  CHECK(plan.CanDispatch(false));
  CHECK(!plan.Vote(false, false));
  CHECK(!plan.Dispatched());  // bucket 0 of 2: the step goes on
  CHECK_EQ(plan.position(), 1u);
  CHECK(!plan.CanDispatch(false));
  CHECK(plan.Arrive(Meta("c", 4), &completes) && completes);
  CHECK(plan.Dispatched());  // the step ended
  CHECK_EQ(plan.steps(), 1);
  CHECK(plan.Finished(0) && plan.Finished(0));
  CHECK(!plan.DoneLeaving());
}

TEST(ARequestThatDoesNotFitVotesAndTheStepLeaves) {
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  bool completes;
  CHECK(!plan.Arrive(Meta("a", 5), &completes));  // other shape
  CHECK(!plan.Arrive(Meta("zzz", 1), &completes));
  // Voting: a new step starts at once, with this rank's vote.
  CHECK(plan.CanDispatch(false));
  CHECK(plan.Vote(false, false));
  plan.Dispatched();
  CHECK(plan.CanDispatch(false));  // the rest of the step runs too
  CHECK(plan.Dispatched());
  CHECK(!plan.Finished(1));  // voted down: not delivered
  CHECK(!plan.DoneLeaving());  // one bucket still in flight
  CHECK(!plan.Finished(2));
  CHECK(plan.DoneLeaving());
  plan.Leave();
  CHECK(!plan.active());
}

TEST(ANameOfABucketAlreadyRunThisStepDoesNotFit) {
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  bool completes;
  plan.Arrive(Meta("a", 2), &completes);
  plan.Arrive(Meta("b", 3), &completes);
  plan.Dispatched();
  CHECK(!plan.Fits(Meta("a", 2)));  // bucket 0 already ran in this step
  CHECK(plan.Fits(Meta("c", 4)));
}

TEST(TheNextStepsCallsMayArriveBeforeTheLastBucketIsDispatched) {
  // A plan whose step ends inside a training step: the next step's "a"
  // comes while bucket 1 is complete here but not yet dispatched.
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  bool completes;
  plan.Arrive(Meta("a", 2), &completes);
  plan.Arrive(Meta("b", 3), &completes);
  plan.Dispatched();
  CHECK(plan.Arrive(Meta("c", 4), &completes) && completes);
  CHECK(plan.Arrive(Meta("a", 2), &completes) && !completes);  // early, no vote
  CHECK(!plan.Vote(false, false));
  CHECK(plan.Dispatched());  // the step ended
  CHECK(plan.Finished(0) && plan.Finished(0));
  // The early call counts for the new step: "b" completes bucket 0.
  CHECK(!plan.CanDispatch(false));
  CHECK(plan.Arrive(Meta("b", 3), &completes) && completes);
  CHECK(plan.CanDispatch(false));
  CHECK(!plan.Vote(false, false));
}

TEST(AnEarlierBucketsNameWhileThisStepStillLacksTensorsVotes) {
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  bool completes;
  plan.Arrive(Meta("a", 2), &completes);
  plan.Arrive(Meta("b", 3), &completes);
  plan.Dispatched();
  CHECK(!plan.Arrive(Meta("a", 2), &completes));  // "c" has not come: the step changed
  CHECK(plan.Vote(false, false));
}

TEST(PlanCheckDueEveryNSteps) {
  OfflinePlan plan;
  plan.Enter(TwoBuckets());
  CHECK(!plan.CheckDue(0));
  CHECK(plan.CheckDue(2));  // before step 0
  plan.Checked();
  CHECK(!plan.CheckDue(2));
  bool completes;
  for (int step = 0; step < 2; ++step) {
    for (const char* n : {"a", "b", "c"}) plan.Arrive(Meta(n, n[0] == 'a' ? 2 : n[0] == 'b' ? 3 : 4), &completes);
    plan.Dispatched();
    plan.Dispatched();
  }
  CHECK_EQ(plan.steps(), 2);
  CHECK(plan.CheckDue(2));
}

TEST(PlanBucketBytes) {
  CHECK_EQ(PlanBucketBytes(100 << 20, 0, 64 << 20), 0);          // no fusion
  CHECK_EQ(PlanBucketBytes(100, 3, 64 << 20), 34);               // about a third
  CHECK_EQ(PlanBucketBytes(1, 4, 64 << 20), 1);                  // at least one byte
  CHECK_EQ(PlanBucketBytes(1 << 20, -1, 64 << 20), int64_t{4} << 20);  // at least 4 MiB
  CHECK_EQ(PlanBucketBytes(int64_t{1} << 30, -1, 64 << 20), int64_t{64} << 20);  // the threshold
  CHECK_EQ(PlanBucketBytes(100 << 20, -1, 64 << 20), (int64_t{100} << 20) / 20 * 11 + 1);
}

TEST(BucketExtrasRoundTripInEachDtype) {
  Response r;
  r.carrier_vote = 1;
  r.perf_slots = 3;
  r.perf_value = 12.0;
  CHECK_EQ(ExtraSlots(r), 4u);
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                         DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
    std::vector<char> buf(4 * 8, 0);
    WriteExtras(buf.data(), dtype, r, 1);  // rank 1 fills slot 1
    BucketOutcome o = ReadOutcome(buf.data(), dtype, r);
    CHECK_EQ(o.votes, 1);
    CHECK_EQ(o.perf_ms.size(), 3u);
    if (o.perf_ms.size() == 3) {
      CHECK_EQ(o.perf_ms[0], 0.0);
      CHECK_EQ(o.perf_ms[1], 12.0);
      CHECK_EQ(o.perf_ms[2], 0.0);
    }
  }
  Response plain;
  CHECK_EQ(ExtraSlots(plain), 0u);
  CHECK(Deliver(plain, BucketOutcome()));
  bool asked = false;
  plain.on_outcome = [&](const BucketOutcome& o) {
    asked = true;
    return o.votes == 0;
  };
  BucketOutcome down;
  down.votes = 2;
  CHECK(!Deliver(plain, down) && asked);
}
