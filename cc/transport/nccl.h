// NCCL, loaded at run time, and communicators that never wait without a
// deadline.
//
// Nothing links against NCCL. NcclLibrary::Load opens libnccl.so.2 from
// PERSEUS_NCCL_LIBRARY when it is set, else from the folders the caller
// names (the nvidia-nccl-cu13/cu12 wheels' lib/), else through the system's
// loader path, and resolves the calls used here. Without it every CPU path
// works, and Load says where it looked and why it failed.
//
// A NcclComm is created non-blocking (config.blocking = 0). Every call that
// answers ncclInProgress is polled with ncclCommGetAsyncError until it
// settles; work on a device stream is polled (with a predicate the caller
// gives, a CUDA event query) together with the communicator's asynchronous
// error. When the deadline passes, or the communicator reports an error (a
// peer died), it is aborted with ncclCommAbort and the call throws a message
// naming the operation, this rank and what happened, as the CPU transports
// do. Rank 0 makes the unique id and shares it through the caller's
// publish/fetch (the rendezvous store).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cc/core/common.h"

namespace perseus {

// The calls used, resolved from the library (NCCL's C ABI).
struct NcclLibrary {
  using Result = int;  // ncclResult_t
  using Comm = void*;  // ncclComm_t
  struct UniqueId {
    char internal[128];
  };
  // The fields of ncclConfig_t up to NCCL 2.14's (later versions read an
  // older, shorter config by its size and version).
  struct Config {
    size_t size = sizeof(Config);
    unsigned int magic = 0xcafebeef;
    unsigned int version = 21400;
    int blocking = 0;
    int cga_cluster_size = -2147483648;
    int min_ctas = -2147483648;
    int max_ctas = -2147483648;
    const char* net_name = nullptr;
  };
  static constexpr Result kSuccess = 0;
  static constexpr Result kInProgress = 7;

  Result (*GetVersion)(int*) = nullptr;
  Result (*GetUniqueId)(UniqueId*) = nullptr;
  Result (*CommInitRankConfig)(Comm*, int, UniqueId, int, Config*) = nullptr;
  Result (*CommGetAsyncError)(Comm, Result*) = nullptr;
  Result (*CommAbort)(Comm) = nullptr;
  Result (*CommDestroy)(Comm) = nullptr;
  Result (*CommCount)(Comm, int*) = nullptr;
  Result (*CommUserRank)(Comm, int*) = nullptr;
  Result (*AllReduce)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  Result (*Broadcast)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  Result (*Reduce)(const void*, void*, size_t, int, int, int, Comm, void*) = nullptr;
  Result (*GroupStart)() = nullptr;
  Result (*GroupEnd)() = nullptr;
  const char* (*GetErrorString)(Result) = nullptr;

  std::string path;
  int version = 0;  // e.g. 22304 for 2.23.4

  // The process's library (loaded once; later calls return the same, or
  // null with the same reason).
  static const NcclLibrary* Load(const std::vector<std::string>& wheel_dirs, std::string* why_not);
  // Loads `path` afresh (tests load a fake library this way).
  static const NcclLibrary* LoadFrom(const std::string& path, std::string* why_not);
};

// NCCL's dtype and reduction for ours; throws std::invalid_argument naming
// the dtype when NCCL has none (uint16, int16: such tensors take the host
// path). bool travels as uint8 (Min and Max are And and Or); Average is a
// sum (the runtime divides afterwards, as on the host).
int NcclDataType(DataType dtype);
int NcclReduceOp(ReduceOp op);

struct NcclBootstrap {
  std::function<void(const std::string& id)> publish;  // rank 0
  // The others; returns false when the id did not come within the wait.
  std::function<bool(std::chrono::milliseconds wait, std::string* id)> fetch;
  // Every rank's `mine` (its GPU), in rank order, into *all; false when
  // some did not come within the wait. Null: the GPUs are not compared.
  std::function<bool(int rank, int size, const std::string& mine, std::chrono::milliseconds wait,
                     std::vector<std::string>* all)>
      gather;
};

class NcclComm {
 public:
  // Collective over `size` ranks; `what` names the communicator in errors
  // ("stream 1 of the world"). Throws std::runtime_error (after aborting)
  // when it is not ready within `timeout`. `device` names this rank's GPU
  // ("host|PCI bus id", DataPlane::DeviceIdentity): when the bootstrap can
  // gather, two ranks naming one GPU fail on every rank, naming both, before
  // NCCL is asked (it refuses them with a less helpful message).
  NcclComm(const NcclLibrary& lib, int rank, int size, const NcclBootstrap& bootstrap,
           std::chrono::milliseconds timeout, const std::string& what,
           const std::string& device = std::string());
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int count() const;  // what NCCL says the communicator's size is

  // Queues the collective on `stream` (a cudaStream_t); returns once NCCL
  // has taken it. Throws (after aborting) on an error or the timeout.
  void Allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                 void* stream);
  void Broadcast(const void* send, void* recv, size_t bytes, int root, void* stream);
  // The reduction of every rank's `send` into `recv` on `root` alone.
  void Reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root,
              void* stream);
  // Waits until finished() (the stream's work is done), checking the
  // communicator's asynchronous error meanwhile; aborts and throws on an
  // error or when the timeout passes.
  void WaitUntil(const std::function<bool()>& finished, const std::string& operation);
  // Aborts the communicator (the thread that calls its collectives; once).
  // Later calls throw.
  void Abort();
  bool aborted() const { return aborted_; }
  // From any thread, at any time (a rank failed, the runtime is closing):
  // the wait in progress on the communicator's own thread, if any, ends
  // within its next poll (about 50 us) by aborting the communicator, so
  // that NCCL's kernels stop too, and throws `why`; so does every later
  // call. NCCL's handle is touched by the owning thread alone: an abort
  // from another thread would free it under a poll in progress.
  void RequestAbort(const std::string& why);

 private:
  // Polls until NCCL answers something other than in-progress.
  void Settle(NcclLibrary::Result r, const std::string& operation);
  [[noreturn]] void Fail(const std::string& operation, const std::string& why);

  const NcclLibrary& lib_;
  NcclLibrary::Comm comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  std::string what_;
  bool aborted_ = false;                       // the owning thread's
  std::atomic<bool> abort_requested_{false};   // any thread's
  std::mutex why_mu_;
  std::string abort_why_;
  // Throws (after aborting) when an abort was requested.
  void CheckAbortRequested(const std::string& operation);
};

}  // namespace perseus
