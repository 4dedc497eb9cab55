// The data plane: where a request's memory lives, and every memory operation
// the executor does on it.
//
// A request's buffers live on the host, or on a device (a simulated one for
// tests, or CUDA device N). Device memory is written by a producer (TF's
// compute stream) that says when the bytes are there with an event; the
// runtime orders its own streams after that event and never blocks the
// producer. Each executor stream has a stream of its own on every device
// plane; work queued there runs in order, asynchronously, and a request is
// complete when its device work is (Finish), not when a call returns.
//
// The executor talks to one interface, DataPlane:
//   HostPlane  today's host code: memcpy, host loops, F16C conversion, and
//              every "asynchronous" operation done by the time it returns;
//   SimPlane   the simulated device (sim_device.h), for tests without a GPU;
//   CudaPlane  CUDA's, in libperseus_cuda.so (cc/cuda/cuda_plane.cu), opened
//              when the first request on a CUDA device comes (cuda_library.h):
//              kernels and copies on the runtime's own non-blocking streams.
// Transports move host memory (Gloo, shared memory): a device buffer is
// staged through host memory around them (ToHost, then FromHost), unless
// NCCL reduces it where it is (nccl.h).
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/core/common.h"

namespace perseus {

enum class MemoryKind : int32_t { kHost = 0, kSimulated = 1, kCuda = 2 };
const char* MemoryKindName(MemoryKind kind);

// Where a request's input and output live. For device memory, `stream` is
// the producer's stream and `ready` its event: the input is fully written
// when the event fires (null: already written). Both are the device's own
// handles (a cudaStream_t/cudaEvent_t, or the simulated device's).
struct Placement {
  MemoryKind kind = MemoryKind::kHost;
  int device = 0;
  void* stream = nullptr;
  std::shared_ptr<void> ready;
};

// One contiguous copy: `bytes` from src to dst (either may be host memory
// when the plane is a device's: copies in and out of a fusion buffer).
struct CopySpan {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};

// The buffers a plane keeps per stream, reused from call to call.
// kLift holds a bucket's host requests on the device (Executor::Lifted).
enum class PlaneBuffer : int { kFusion = 0, kHalf = 1, kStaging = 2, kLift = 3, kCount = 4 };

class DataPlane {
 public:
  virtual ~DataPlane() = default;
  virtual MemoryKind kind() const = 0;
  bool host() const { return kind() == MemoryKind::kHost; }
  virtual int device() const { return 0; }

  // Orders `stream` after the producer's event of `where`.
  virtual void WaitReady(int stream, const Placement& where) = 0;
  // At least `bytes` of the plane's memory for `stream` (kStaging: host
  // memory a transport can use), kept until a larger one is asked for.
  // Growing never frees memory that queued work still uses.
  virtual void* Buffer(int stream, PlaneBuffer which, size_t bytes) = 0;
  // All spans, in one go (one launch on a device).
  virtual void Copy(int stream, const std::vector<CopySpan>& spans) = 0;
  // data[i] *= factor (see ScaleBuffer); nothing when factor is 1.
  virtual void Scale(int stream, void* data, DataType dtype, size_t n, double factor) = 0;
  // out = half(in * scale) and out = float(in) * scale.
  virtual void ToHalf(int stream, const float* in, uint16_t* out, size_t n, float scale) = 0;
  virtual void FromHalf(int stream, const uint16_t* in, float* out, size_t n, float scale) = 0;
  // Waits for the producer, then says whether data holds a NaN or infinity.
  virtual bool HasNonFinite(const Placement& where, const void* data, DataType dtype,
                            size_t n) = 0;
  // Plane memory to host memory: returns once the bytes are on the host
  // (after everything queued on `stream` before it).
  virtual void ToHost(int stream, void* host, const void* src, size_t bytes) = 0;
  // Host memory to plane memory, after what is queued on `stream`. The
  // host bytes may be reused as soon as it returns.
  virtual void FromHost(int stream, void* dst, const void* host, size_t bytes) = 0;
  // Runs `done` (on some thread) once everything queued on `stream` so far
  // has finished; the host plane runs it before returning. `error` is empty,
  // or says what failed in the device work.
  virtual void Finish(int stream, std::function<void(const std::string& error)> done) = 0;
  // The memory the plane holds for its buffers (Buffer, and a device's
  // copy tables) now: on the device, and in (pinned) host memory.
  struct Memory {
    size_t device = 0;
    size_t host = 0;
  };
  virtual Memory BufferMemory() const { return {}; }
  // Which physical device this is, for NCCL's one-GPU-per-rank check:
  // "host|PCI bus id" (the host as NCCL tells hosts apart: NCCL_HOSTID,
  // else the host name); empty for planes without one.
  virtual std::string DeviceIdentity() const { return ""; }
  // The device's own handle of `stream` (a cudaStream_t), for transports
  // that queue work on it (NCCL); null on planes without one.
  virtual void* NativeStream(int stream) { return nullptr; }
  // Makes the plane's device the calling thread's current one, for work
  // that reaches the device through something else than the plane (NCCL
  // binds a communicator to the device current when it is made, and
  // queues on it); a no-op on planes without a device.
  virtual void MakeCurrent() {}
  // A test that says whether the work queued on `stream` so far has
  // finished (for transports that poll with a deadline); planes that finish
  // everything before returning answer true at once.
  virtual std::function<bool()> Marker(int stream) {
    return [] { return true; };
  }
};

// The host's plane (stateless apart from its buffers).
std::unique_ptr<DataPlane> MakeHostPlane(int streams);
// The simulated device's plane, with `streams` streams of its own there.
std::unique_ptr<DataPlane> MakeSimPlane(int streams);

}  // namespace perseus
