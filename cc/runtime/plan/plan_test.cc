#include "cc/runtime/plan/plan.h"

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

TEST(EnvelopeCarriesItsExtrasThroughTheReduceInEachDtype) {
  Envelope e;
  e.vote = 1;
  e.perf_slots = 3;
  e.perf_value = 12.0;
  CHECK_EQ(e.slots(), 4u);
  for (DataType dtype : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                         DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
    const size_t esize = DataTypeSize(dtype);
    std::vector<char> buf((2 + e.slots()) * esize, 0);
    BucketOutcome seen;
    e.on_outcome = [&](const BucketOutcome& o) {
      seen = o;
      return o.votes == 0;
    };
    size_t reduced = 0;
    // Host memory (no plane); the "reduce" adds a second rank that votes to
    // stay and reports 5 ms in slot 0, after the bucket's two elements.
    const bool deliver = e.Around(buf.data(), 2, dtype, 1, nullptr, 0, [&](size_t count) {
      reduced = count;
      const double slot0 = ReadValue(buf.data() + 3 * esize, dtype);
      WriteValue(buf.data() + 3 * esize, dtype, slot0 + 5.0);
    });
    CHECK_EQ(reduced, 2u + 4u);
    CHECK(!deliver);  // one vote to leave: not delivered
    CHECK_EQ(seen.votes, 1);
    CHECK_EQ(seen.perf_ms.size(), 3u);
    if (seen.perf_ms.size() == 3) {
      CHECK_EQ(seen.perf_ms[0], 5.0);   // the other rank's
      CHECK_EQ(seen.perf_ms[1], 12.0);  // rank 1 fills slot 1
      CHECK_EQ(seen.perf_ms[2], 0.0);
    }
  }
  Envelope none;  // outside a plan: the reduce sees the data alone, delivered
  CHECK(none.empty() && none.slots() == 0u);
  size_t reduced = 0;
  float x[2] = {1, 2};
  CHECK(none.Around(x, 2, DataType::kFloat32, 0, nullptr, 0, [&](size_t n) { reduced = n; }));
  CHECK_EQ(reduced, 2u);
  Envelope stay;
  stay.vote = 0;
  std::vector<float> y(3, 0);
  bool asked = false;
  stay.on_outcome = [&](const BucketOutcome& o) {
    asked = true;
    return o.votes == 0;
  };
  CHECK(stay.Around(y.data(), 2, DataType::kFloat32, 0, nullptr, 0, [](size_t) {}) && asked);
}
