// NCCL through the fake library (cc/testing/fake_nccl.cc), which
// tests/test_cc_unit.py builds and names in PERSEUS_TEST_FAKE_NCCL.
#include "cc/transport/nccl.h"

#include <condition_variable>
#include <map>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "cc/core/shared_library.h"
#include "cc/testing/check.h"

namespace perseus {
namespace {

using std::chrono::milliseconds;

std::string FakePath() {
  const char* p = std::getenv("PERSEUS_TEST_FAKE_NCCL");
  return p ? p : "";
}

int FakeCounter(const char* name) {
  SharedLibrary fake(FakePath(), /*no_load=*/true);
  int (*fn)() = nullptr;
  return fake.ok() && fake.Find(name, &fn) ? fn() : -1;
}

const NcclLibrary* Fake() {
  std::string why;
  const NcclLibrary* lib = NcclLibrary::LoadFrom(FakePath(), &why);
  if (lib == nullptr) std::fprintf(stderr, "fake NCCL: %s\n", why.c_str());
  return lib;
}

// The rendezvous store, in memory: rank 0 publishes, the others wait.
struct Board {
  std::mutex mu;
  std::condition_variable cv;
  std::string id;
  NcclBootstrap For() {
    NcclBootstrap b;
    b.publish = [this](const std::string& v) {
      std::lock_guard<std::mutex> lock(mu);
      id = v;
      cv.notify_all();
    };
    b.fetch = [this](milliseconds wait, std::string* out) {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, wait, [&] { return !id.empty(); })) return false;
      *out = id;
      return true;
    };
    return b;
  }
};

// Board's gather: every rank's GPU, in memory.
struct GpuBoard {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::string> gpus;
  NcclBootstrap For(Board& ids) {
    NcclBootstrap b = ids.For();
    b.gather = [this](int rank, int size, const std::string& mine, milliseconds wait,
                      std::vector<std::string>* all) {
      std::unique_lock<std::mutex> lock(mu);
      gpus[rank] = mine;
      cv.notify_all();
      if (!cv.wait_for(lock, wait, [&] { return static_cast<int>(gpus.size()) == size; })) {
        return false;
      }
      all->clear();
      for (auto& entry : gpus) all->push_back(entry.second);
      return true;
    };
    return b;
  }
};

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool Has(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return true;
  std::fprintf(stderr, "expected '%s' in: %s\n", part.c_str(), text.c_str());
  return false;
}

TEST(NcclLoadSaysWhyItCannotOpenTheLibrary) {
  std::string why;
  CHECK(NcclLibrary::LoadFrom("/nonexistent/libnccl.so.2", &why) == nullptr);
  CHECK(Has(why, "cannot open /nonexistent/libnccl.so.2"));
}

TEST(NcclLoadsTheFakeAndRefusesOldVersions) {
  CHECK(!FakePath().empty());
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  CHECK_EQ(lib->version, 22304);
  setenv("FAKE_NCCL_VERSION", "21004", 1);
  std::string why;
  CHECK(NcclLibrary::LoadFrom(FakePath(), &why) == nullptr);
  CHECK(Has(why, "2.14 (21400) or later"));
  unsetenv("FAKE_NCCL_VERSION");
}

TEST(NcclTypesMapAndRefuseWhatNcclLacks) {
  CHECK_EQ(NcclDataType(DataType::kFloat32), 7);
  CHECK_EQ(NcclDataType(DataType::kBFloat16), 9);
  CHECK_EQ(NcclDataType(DataType::kBool), 1);
  CHECK_EQ(NcclReduceOp(ReduceOp::kAverage), 0);
  CHECK_EQ(NcclReduceOp(ReduceOp::kMin), 3);
  CHECK(Has(ErrorOf([] { NcclDataType(DataType::kInt16); }), "NCCL has no int16 type"));
}

TEST(NcclTwoRanksShareRankZerosIdAndSum) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  unsetenv("FAKE_NCCL_SCRIPT");
  Board board;
  float a[3] = {1, 2, 3}, b[3] = {10, 20, 30}, ra[3] = {0}, rb[3] = {0};
  std::string err0, err1;
  int count0 = 0, count1 = 0;
  std::thread other([&] {
    err1 = ErrorOf([&] {
      NcclComm comm(*lib, 1, 2, board.For(), milliseconds(5000), "test");
      count1 = comm.count();
      comm.Allreduce(b, rb, 3, DataType::kFloat32, ReduceOp::kSum, nullptr);
      comm.WaitUntil([] { return true; }, "allreduce");
    });
  });
  err0 = ErrorOf([&] {
    NcclComm comm(*lib, 0, 2, board.For(), milliseconds(5000), "test");
    count0 = comm.count();
    comm.Allreduce(a, ra, 3, DataType::kFloat32, ReduceOp::kSum, nullptr);
  });
  other.join();
  CHECK(err0.empty() && err1.empty());
  CHECK_EQ(count0, 2);
  CHECK_EQ(count1, 2);
  CHECK(ra[0] == 11 && ra[2] == 33 && rb[1] == 22);
  CHECK_EQ(FakeCounter("fake_nccl_last_blocking"), 0);  // created non-blocking
}

// Two ranks naming one GPU (NCCL refuses them at init) fail on both ranks,
// naming both and what to change; one GPU each makes the communicator.
TEST(NcclTwoRanksOnOneGpuAreNamedOnEveryRank) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  unsetenv("FAKE_NCCL_SCRIPT");
  for (bool shared : {true, false}) {
    Board ids;
    GpuBoard gpus;
    std::string err0, err1;
    std::thread other([&] {
      err1 = ErrorOf([&] {
        NcclComm comm(*lib, 1, 2, gpus.For(ids), milliseconds(5000), "stream 0 of the world",
                      shared ? "node7|0000:1A:00.0" : "node7|0000:1B:00.0");
      });
    });
    err0 = ErrorOf([&] {
      NcclComm comm(*lib, 0, 2, gpus.For(ids), milliseconds(5000), "stream 0 of the world",
                    "node7|0000:1A:00.0");
    });
    other.join();
    if (shared) {
      for (const std::string& err : {err0, err1}) {
        CHECK(Has(err, "NCCL stream 0 of the world: ranks 0 and 1 both use GPU 0000:1A:00.0 "
                       "of host node7"));
        CHECK(Has(err, "PERSEUS_GPU_TRANSPORT=host"));
      }
    } else {
      CHECK(err0.empty() && err1.empty());
    }
  }
}

TEST(NcclReduceLeavesTheSumOnTheRootAlone) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  unsetenv("FAKE_NCCL_SCRIPT");
  Board board;
  float a[2] = {1, 2}, b[2] = {10, 20}, ra[2] = {-1, -1}, rb[2] = {-1, -1};
  std::string err1;
  std::thread other([&] {
    err1 = ErrorOf([&] {
      NcclComm comm(*lib, 1, 2, board.For(), milliseconds(5000), "test");
      comm.Reduce(b, rb, 2, DataType::kFloat32, ReduceOp::kSum, 1, nullptr);
    });
  });
  const std::string err0 = ErrorOf([&] {
    NcclComm comm(*lib, 0, 2, board.For(), milliseconds(5000), "test");
    comm.Reduce(a, ra, 2, DataType::kFloat32, ReduceOp::kSum, 1, nullptr);
  });
  other.join();
  CHECK(err0.empty() && err1.empty());
  CHECK(rb[0] == 11 && rb[1] == 22);
  CHECK(ra[0] == -1 && ra[1] == -1);
}

TEST(NcclCommunicatorThatNeverBecomesReadyIsAbortedAtTheDeadline) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  setenv("FAKE_NCCL_SCRIPT", "init_hang", 1);
  const int aborts = FakeCounter("fake_nccl_aborts");
  Board board;
  auto start = std::chrono::steady_clock::now();
  std::string err = ErrorOf([&] { NcclComm comm(*lib, 0, 1, board.For(), milliseconds(300), "stream 0"); });
  auto took = std::chrono::steady_clock::now() - start;
  unsetenv("FAKE_NCCL_SCRIPT");
  CHECK(Has(err, "NCCL stream 0, rank 0 of 1: creating the communicator did not finish within"));
  CHECK(Has(err, "the communicator was aborted"));
  CHECK(took < std::chrono::seconds(5));
  CHECK_EQ(FakeCounter("fake_nccl_aborts"), aborts + 1);
}

TEST(NcclRankWithoutTheIdGivesUpNamingRankZero) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  Board board;  // nobody publishes
  std::string err = ErrorOf([&] { NcclComm comm(*lib, 1, 2, board.For(), milliseconds(200), "test"); });
  CHECK(Has(err, "rank 1 did not get the unique id from rank 0"));
}

TEST(NcclCollectiveErrorsAndHangsAbortAndName) {
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  unsetenv("FAKE_NCCL_SCRIPT");
  float x[2] = {1, 2}, y[2];
  {
    Board board;
    NcclComm comm(*lib, 0, 1, board.For(), milliseconds(300), "stream 1");
    comm.Allreduce(x, y, 2, DataType::kFloat32, ReduceOp::kSum, nullptr);
    CHECK(y[1] == 2);
    const int aborts = FakeCounter("fake_nccl_aborts");
    setenv("FAKE_NCCL_SCRIPT", "allreduce_error", 1);
    std::string err = ErrorOf([&] {
      comm.Allreduce(x, y, 2, DataType::kFloat32, ReduceOp::kSum, nullptr);
    });
    CHECK(Has(err, "allreduce failed: remote process exited"));
    CHECK(comm.aborted());
    CHECK_EQ(FakeCounter("fake_nccl_aborts"), aborts + 1);
    err = ErrorOf([&] { comm.Allreduce(x, y, 2, DataType::kFloat32, ReduceOp::kSum, nullptr); });
    CHECK(Has(err, "cannot run: an earlier error"));
    unsetenv("FAKE_NCCL_SCRIPT");
  }
  {
    Board board;
    NcclComm comm(*lib, 0, 1, board.For(), milliseconds(300), "stream 2");
    setenv("FAKE_NCCL_SCRIPT", "allreduce_hang", 1);
    std::string err = ErrorOf([&] {
      comm.Allreduce(x, y, 2, DataType::kFloat32, ReduceOp::kSum, nullptr);
    });
    unsetenv("FAKE_NCCL_SCRIPT");
    CHECK(Has(err, "allreduce did not finish within"));
  }
  {
    Board board;
    NcclComm comm(*lib, 0, 1, board.For(), milliseconds(300), "stream 3");
    std::string err = ErrorOf([&] { comm.WaitUntil([] { return false; }, "the device's work"); });
    CHECK(Has(err, "the device's work did not finish within"));
  }
}

TEST(NcclWaitsEndSoonAfterAnAbortRequestedFromAnotherThread) {
  // A peer died: the runtime's failure path asks every communicator to stop
  // from its own thread. The stream thread's wait ends within a poll or so,
  // NCCL's work is aborted, and later calls fail at once, all saying why;
  // not at the 60 s deadline.
  const NcclLibrary* lib = Fake();
  CHECK(lib != nullptr);
  if (lib == nullptr) return;
  unsetenv("FAKE_NCCL_SCRIPT");
  Board board;
  NcclComm comm(*lib, 0, 1, board.For(), milliseconds(60000), "stream 0 of the world");
  float x[2] = {1, 2}, y[2];
  setenv("FAKE_NCCL_SCRIPT", "allreduce_hang", 1);
  const int aborts = FakeCounter("fake_nccl_aborts");
  const auto start = std::chrono::steady_clock::now();
  std::thread failure([&] {
    std::this_thread::sleep_for(milliseconds(200));
    comm.RequestAbort("rank 3 failed");
  });
  std::string err = ErrorOf([&] {
    comm.Allreduce(x, y, 2, DataType::kFloat32, ReduceOp::kSum, nullptr);
    comm.WaitUntil([] { return false; }, "allreduce");
  });
  failure.join();
  unsetenv("FAKE_NCCL_SCRIPT");
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(took < milliseconds(1500));
  CHECK(Has(err, "stream 0 of the world"));
  CHECK(Has(err, "stopped: rank 3 failed"));
  CHECK(comm.aborted());
  CHECK_EQ(FakeCounter("fake_nccl_aborts"), aborts + 1);
  err = ErrorOf([&] { comm.Broadcast(x, y, 8, 0, nullptr); });
  CHECK(Has(err, "rank 3 failed") || Has(err, "an earlier error"));
}

}  // namespace
}  // namespace perseus
