#include "cc/transport/nccl.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "cc/core/shared_library.h"

namespace perseus {
namespace {

std::mutex load_mu;

}  // namespace

const NcclLibrary* NcclLibrary::LoadFrom(const std::string& path, std::string* why_not) {
  SharedLibrary handle(path);
  if (!handle.ok()) {
    *why_not = "cannot open " + path + ": " + handle.error();
    return nullptr;
  }
  std::unique_ptr<NcclLibrary> lib(new NcclLibrary());
  handle.Find("ncclGetVersion", &lib->GetVersion);
  handle.Find("ncclGetUniqueId", &lib->GetUniqueId);
  handle.Find("ncclCommInitRankConfig", &lib->CommInitRankConfig);
  handle.Find("ncclCommGetAsyncError", &lib->CommGetAsyncError);
  handle.Find("ncclCommAbort", &lib->CommAbort);
  handle.Find("ncclCommDestroy", &lib->CommDestroy);
  handle.Find("ncclCommCount", &lib->CommCount);
  handle.Find("ncclCommUserRank", &lib->CommUserRank);
  handle.Find("ncclAllReduce", &lib->AllReduce);
  handle.Find("ncclBroadcast", &lib->Broadcast);
  handle.Find("ncclReduce", &lib->Reduce);
  handle.Find("ncclGroupStart", &lib->GroupStart);
  handle.Find("ncclGroupEnd", &lib->GroupEnd);
  handle.Find("ncclGetErrorString", &lib->GetErrorString);
  if (!handle.missing().empty()) {
    *why_not = path + " lacks " + handle.missing() + " (NCCL 2.14 or later is needed)";
    handle.Close();
    return nullptr;
  }
  if (lib->GetVersion(&lib->version) != kSuccess || lib->version < 21400) {
    *why_not = path + " is NCCL version code " + std::to_string(lib->version) +
               "; 2.14 (21400) or later is needed for non-blocking communicators";
    handle.Close();
    return nullptr;
  }
  lib->path = path;
  return lib.release();  // kept for the life of the process, like the library
}

const NcclLibrary* NcclLibrary::Load(const std::vector<std::string>& wheel_dirs,
                                     std::string* why_not) {
  std::lock_guard<std::mutex> lock(load_mu);
  static bool tried = false;
  static const NcclLibrary* loaded = nullptr;
  static std::string reason;
  if (tried) {
    if (!loaded) *why_not = reason;
    return loaded;
  }
  tried = true;
  std::vector<std::string> candidates;
  const char* env = std::getenv("PERSEUS_NCCL_LIBRARY");
  if (env != nullptr && *env != '\0') {
    candidates.push_back(env);  // only this one: the user asked for it
  } else {
    for (const std::string& dir : wheel_dirs) candidates.push_back(dir + "/libnccl.so.2");
    candidates.push_back("libnccl.so.2");  // the loader's path
  }
  std::string tried_why;
  for (const std::string& path : candidates) {
    std::string why;
    loaded = LoadFrom(path, &why);
    if (loaded) return loaded;
    tried_why += (tried_why.empty() ? "" : "; ") + why;
  }
  reason = "NCCL is not available (" + tried_why + ")" +
           (env && *env ? "" : "; set PERSEUS_NCCL_LIBRARY to its libnccl.so.2, or install "
                               "the nvidia-nccl-cu12 or nvidia-nccl-cu13 wheel");
  *why_not = reason;
  return nullptr;
}

int NcclDataType(DataType dtype) {
  switch (dtype) {
    case DataType::kInt8: return 0;
    case DataType::kUint8:
    case DataType::kBool: return 1;
    case DataType::kInt32: return 2;
    case DataType::kInt64: return 4;
    case DataType::kFloat16: return 6;
    case DataType::kFloat32: return 7;
    case DataType::kFloat64: return 8;
    case DataType::kBFloat16: return 9;
    default:
      throw std::invalid_argument(std::string("NCCL has no ") + DataTypeName(dtype) +
                                  " type: such tensors take the host path");
  }
}

int NcclReduceOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return 0;
    case ReduceOp::kProduct: return 1;
    case ReduceOp::kMax: return 2;
    case ReduceOp::kMin: return 3;
  }
  throw std::invalid_argument("unknown reduction");
}

// Two ranks of `all` naming one GPU: an error naming both, else empty.
static std::string SharedGpu(const std::vector<std::string>& all, const std::string& what) {
  for (size_t a = 0; a < all.size(); ++a) {
    for (size_t b = a + 1; b < all.size(); ++b) {
      if (all[a].empty() || all[a] != all[b]) continue;
      const size_t bar = all[a].find('|');
      const std::string host = bar == std::string::npos ? "?" : all[a].substr(0, bar);
      const std::string gpu = bar == std::string::npos ? all[a] : all[a].substr(bar + 1);
      return "NCCL " + what + ": ranks " + std::to_string(a) + " and " + std::to_string(b) +
             " both use GPU " + gpu + " of host " + host +
             ", and NCCL needs a GPU per rank: start at most as many ranks per host as it has "
             "GPUs, give each rank its own GPU (CUDA_VISIBLE_DEVICES, or pin with "
             "hvd.local_rank() / perseus_tf.gpu.pin()), or set PERSEUS_GPU_TRANSPORT=host on "
             "every rank";
    }
  }
  return "";
}

NcclComm::NcclComm(const NcclLibrary& lib, int rank, int size, const NcclBootstrap& bootstrap,
                   std::chrono::milliseconds timeout, const std::string& what,
                   const std::string& device)
    : lib_(lib), rank_(rank), size_(size), timeout_(timeout), what_(what) {
  if (bootstrap.gather && !device.empty() && size > 1) {
    std::vector<std::string> all;
    if (!bootstrap.gather(rank, size, device, timeout_, &all)) {
      throw std::runtime_error("NCCL " + what_ + ": rank " + std::to_string(rank) +
                               " did not hear from every rank which GPU it uses within " +
                               std::to_string(timeout_.count() / 1000) +
                               " s (GLOO_TIMEOUT_SECONDS); is every rank alive?");
    }
    const std::string shared = SharedGpu(all, what_);
    if (!shared.empty()) throw std::runtime_error(shared);
  }
  NcclLibrary::UniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    NcclLibrary::Result r = lib_.GetUniqueId(&id);
    if (r != NcclLibrary::kSuccess) {
      throw std::runtime_error("NCCL " + what_ + ": rank 0 could not make the unique id: " +
                               lib_.GetErrorString(r));
    }
    bootstrap.publish(std::string(id.internal, sizeof(id.internal)));
  } else {
    std::string got;
    if (!bootstrap.fetch(timeout_, &got) || got.size() != sizeof(id.internal)) {
      throw std::runtime_error("NCCL " + what_ + ": rank " + std::to_string(rank) +
                               " did not get the unique id from rank 0 within " +
                               std::to_string(timeout_.count() / 1000) +
                               " s (GLOO_TIMEOUT_SECONDS); is rank 0 alive?");
    }
    std::memcpy(id.internal, got.data(), sizeof(id.internal));
  }
  NcclLibrary::Config config;
  config.blocking = 0;
  NcclLibrary::Result r = lib_.CommInitRankConfig(&comm_, size, id, rank, &config);
  if (comm_ == nullptr && r != NcclLibrary::kSuccess && r != NcclLibrary::kInProgress) {
    throw std::runtime_error("NCCL " + what_ + ": rank " + std::to_string(rank) +
                             " could not create its communicator: " + lib_.GetErrorString(r));
  }
  Settle(r, "creating the communicator");
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr || aborted_) return;
  // A communicator whose work is still in flight is aborted, not destroyed:
  // destroying waits for that work, without a deadline.
  NcclLibrary::Result state = NcclLibrary::kSuccess;
  lib_.CommGetAsyncError(comm_, &state);
  if (state == NcclLibrary::kSuccess) {
    lib_.CommDestroy(comm_);
  } else {
    lib_.CommAbort(comm_);
  }
}

int NcclComm::count() const {
  int n = 0;
  lib_.CommCount(comm_, &n);
  return n;
}

void NcclComm::Abort() {
  if (aborted_ || comm_ == nullptr) return;
  aborted_ = true;
  lib_.CommAbort(comm_);
}

void NcclComm::RequestAbort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    if (abort_requested_) return;
    abort_why_ = why;
  }
  abort_requested_ = true;
}

void NcclComm::CheckAbortRequested(const std::string& operation) {
  if (!abort_requested_.load(std::memory_order_relaxed)) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why = abort_why_;
  }
  Fail(operation, "stopped: " + why);
}

void NcclComm::Fail(const std::string& operation, const std::string& why) {
  Abort();
  throw std::runtime_error("NCCL " + what_ + ", rank " + std::to_string(rank_) + " of " +
                           std::to_string(size_) + ": " + operation + " " + why +
                           "; the communicator was aborted");
}

// Polls of NCCL's progress back off to at most this: an operation is seen
// done within ~50 us (the 2 ms of before added up to 2 ms to every call).
constexpr std::chrono::microseconds kMaxPoll(50);

void NcclComm::Settle(NcclLibrary::Result r, const std::string& operation) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto sleep = std::chrono::microseconds(20);
  while (r == NcclLibrary::kInProgress) {
    CheckAbortRequested(operation);
    if (std::chrono::steady_clock::now() >= deadline) {
      Fail(operation, "did not finish within " + std::to_string(timeout_.count() / 1000.0) +
                          " s (GLOO_TIMEOUT_SECONDS): a rank is missing, dead or stuck");
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, kMaxPoll);
    if (lib_.CommGetAsyncError(comm_, &r) != NcclLibrary::kSuccess) break;
  }
  if (r != NcclLibrary::kSuccess) Fail(operation, std::string("failed: ") + lib_.GetErrorString(r));
}

void NcclComm::Allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                         void* stream) {
  CheckAbortRequested("allreduce");
  if (aborted_) Fail("allreduce", "cannot run: an earlier error");
  const int type = NcclDataType(dtype), red = NcclReduceOp(op);
  Settle(lib_.AllReduce(send, recv, count, type, red, comm_, stream), "allreduce");
}

void NcclComm::Broadcast(const void* send, void* recv, size_t bytes, int root, void* stream) {
  CheckAbortRequested("broadcast");
  if (aborted_) Fail("broadcast", "cannot run: an earlier error");
  Settle(lib_.Broadcast(send, recv, bytes, NcclDataType(DataType::kUint8), root, comm_, stream),
         "broadcast");
}

void NcclComm::Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root, void* stream) {
  CheckAbortRequested("reduce");
  if (aborted_) Fail("reduce", "cannot run: an earlier error");
  const int type = NcclDataType(dtype), red = NcclReduceOp(op);
  Settle(lib_.Reduce(send, recv, count, type, red, root, comm_, stream), "reduce");
}

void NcclComm::WaitUntil(const std::function<bool()>& finished, const std::string& operation) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto sleep = std::chrono::microseconds(20);
  while (!finished()) {
    CheckAbortRequested(operation);
    NcclLibrary::Result state = NcclLibrary::kSuccess;
    lib_.CommGetAsyncError(comm_, &state);
    if (state != NcclLibrary::kSuccess && state != NcclLibrary::kInProgress) {
      Fail(operation, std::string("failed: ") + lib_.GetErrorString(state));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      Fail(operation, "did not finish within " + std::to_string(timeout_.count() / 1000.0) +
                          " s (GLOO_TIMEOUT_SECONDS): a rank is missing, dead or stuck");
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, kMaxPoll);
  }
}

}  // namespace perseus
