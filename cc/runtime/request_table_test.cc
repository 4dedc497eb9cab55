#include "cc/runtime/request_table.h"

#include <thread>

#include "cc/testing/check.h"

using namespace perseus;

namespace {

// A single-tensor call whose `done` records the status it completed with.
std::shared_ptr<Request> Call(const std::string& name, Status* result) {
  auto q = std::make_shared<Request>();
  q->meta.name = name;
  q->meta.op = OpType::kAllreduce;
  q->meta.shape = {4};
  q->done = [result](const Status& s) { *result = s; };
  return q;
}

Status SubmitOne(RequestTable& table, const std::shared_ptr<Request>& q) {
  bool closed = false;
  Status s = table.Submit({q}, RequestTable::Clock::now(), &closed);
  CHECK(!closed);
  return s;
}

// The cycle takes what is queued, as the controller does.
std::vector<TensorMeta> Sent(RequestTable& table) {
  auto now = RequestTable::Clock::now();
  return table.TakeQueued(now, now).requests;
}

Response Ok(const std::string& name) {
  Response r;
  r.op = OpType::kAllreduce;
  r.names = {name};
  return r;
}

}  // namespace

TEST(ASecondCallOfANameInFlightFailsBothAndTellsTheOthers) {
  RequestTable table;
  table.Open(1);
  Status first = Status::Error(StatusCode::kUnavailable, "not done");
  Status second = first;
  auto a = Call("x", &first);
  CHECK(SubmitOne(table, a).ok());
  CHECK_EQ(Sent(table).size(), 1u);
  // Negotiated and running: no longer pending, still in flight.
  RequestTable::Taken taken = table.TakeResponse(Ok("x"), false);
  CHECK_EQ(taken.requests.size(), 1u);
  Status refused = SubmitOne(table, Call("x", &second));
  CHECK(!refused.ok());
  CHECK(refused.message.find("two calls of this name were in flight at once on rank 1") !=
        std::string::npos);
  // The others hear of it: a refusal of "x" goes out with the next cycle.
  std::vector<TensorMeta> sent = Sent(table);
  CHECK_EQ(sent.size(), 1u);
  CHECK(sent[0].name == "x" && (sent[0].flags & kMetaRejected));
  // The call in flight completes with an error though its collective ran.
  taken.requests[0]->done(Status::OK());
  CHECK(!first.ok());
  CHECK(first.message.find("'x' is not applied: two calls") != std::string::npos);
  // Once it completed, the name is free: a later call is accepted.
  Status third = first;
  CHECK(SubmitOne(table, Call("x", &third)).ok());
}

TEST(ACallMadeAgainAfterTheFirstCompletedIsAccepted) {
  RequestTable table;
  table.Open(0);
  for (int i = 0; i < 200; ++i) {  // past the sweep of finished entries
    Status result = Status::Error(StatusCode::kUnavailable, "not done");
    const std::string name = i % 2 ? "same" : "n" + std::to_string(i);
    CHECK(SubmitOne(table, Call(name, &result)).ok());
    CHECK_EQ(Sent(table).size(), 1u);
    RequestTable::Taken taken = table.TakeResponse(Ok(name), false);
    CHECK_EQ(taken.requests.size(), 1u);
    taken.requests[0]->done(Status::OK());
    CHECK(result.ok());
  }
}

TEST(ANameTwiceInOneCallIsRefusedLocallyAndLeavesNothing) {
  RequestTable table;
  table.Open(0);
  Status ra, rb;
  bool closed = false;
  Status s = table.Submit({Call("t.a", &ra), Call("t.a", &rb)}, RequestTable::Clock::now(),
                          &closed);
  CHECK(!s.ok() && s.message.find("names this tensor twice") != std::string::npos);
  CHECK(!table.HasPending());
  CHECK(Sent(table).empty());  // nothing for the others: every rank refuses it alike
}

TEST(TwoThreadsCallingOneNameNeverBothSucceed) {
  // Whatever the interleaving, at most one of two overlapping calls is
  // accepted, and if the second came while the first was in flight, the
  // first fails too.
  for (int round = 0; round < 200; ++round) {
    RequestTable table;
    table.Open(0);
    Status results[2] = {Status::Error(StatusCode::kUnavailable, "not done"),
                         Status::Error(StatusCode::kUnavailable, "not done")};
    Status submitted[2];
    std::thread threads[2];
    for (int t = 0; t < 2; ++t) {
      threads[t] = std::thread(
          [&, t] { submitted[t] = SubmitOne(table, Call("x", &results[t])); });
    }
    for (auto& t : threads) t.join();
    CHECK(!submitted[0].ok() || !submitted[1].ok());
    const int accepted = submitted[0].ok() ? 0 : 1;
    CHECK(submitted[accepted].ok());
    RequestTable::Taken taken = table.TakeResponse(Ok("x"), false);
    CHECK_EQ(taken.requests.size(), 1u);
    taken.requests[0]->done(Status::OK());
    CHECK(!results[accepted].ok());
  }
}
