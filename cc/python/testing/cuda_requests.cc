// PERSEUS_TEST_DEVICE=cuda (sim_requests.h): the _core collectives on a GPU,
// handed over as a TF GPU kernel would hand them over.
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/device/cuda_library.h"
#include "cc/python/testing/sim_requests.h"
#include "cc/transport/nccl.h"

namespace perseus {
namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v ? std::atoi(v) : fallback;
}

// The device memory one request holds until it completes.
struct Held {
  const CudaLibrary* lib = nullptr;
  int device = 0;
  std::vector<void*> ptrs;
  void* result = nullptr;
  void* result_host = nullptr;
  size_t result_bytes = 0;
};

}  // namespace

void PlaceOnCudaDevice(Request& req, void* host_out) {
  std::string why;
  const CudaLibrary* lib = CudaLibrary::Load(&why);
  if (lib == nullptr) throw std::runtime_error("PERSEUS_TEST_DEVICE=cuda: " + why);
  auto held = std::make_shared<Held>();
  held->lib = lib;
  // "local": the rank's local rank (one device per rank, as jobs run on a
  // machine of several GPUs); else a device ordinal (default 0).
  const char* which = std::getenv("PERSEUS_TEST_CUDA_DEVICE");
  held->device = which != nullptr && std::string(which) == "local"
                     ? EnvInt("PERSEUS_LOCAL_RANK", 0)
                     : EnvInt("PERSEUS_TEST_CUDA_DEVICE", 0);
  const int device = held->device;
  const size_t esize = DataTypeSize(req.meta.dtype);
  const size_t bytes = static_cast<size_t>(NumElements(req.meta.shape)) * esize;
  const void* host_in = req.input;
  void* din = nullptr;
  lib->Check(lib->test_alloc(device, bytes, &din), "allocating device memory");
  held->ptrs.push_back(din);
  // The output first, so that the producer's event below covers its fill.
  void* dout = nullptr;
  if (host_out != nullptr) {
    if (host_out == host_in) {
      dout = din;
    } else {
      lib->Check(lib->test_alloc(device, bytes, &dout), "allocating device memory");
      held->ptrs.push_back(dout);
    }
  }
  void* stream = nullptr;
  void* event = nullptr;
  lib->Check(lib->test_produce(device, din, host_in, host_in ? bytes : 0,
                               EnvInt("PERSEUS_TEST_CUDA_DELAY_US", 20), &stream, &event),
             "the test's producer stream");
  req.where.kind = MemoryKind::kCuda;
  req.where.device = device;
  req.where.stream = stream;
  req.where.ready = std::shared_ptr<void>(event, [lib](void* e) { lib->event_destroy(e); });
  req.input = din;
  if (host_out != nullptr) req.output = dout;
  if (req.allocate) {
    auto host_allocate = req.allocate;
    req.allocate = [held, host_allocate, esize,
                    stream](const std::vector<int64_t>& shape) -> void* {
      const CudaLibrary& lib = *held->lib;
      held->result_bytes = static_cast<size_t>(NumElements(shape)) * esize;
      held->result_host = host_allocate(shape);
      lib.Check(lib.test_alloc(held->device, held->result_bytes, &held->result),
                "allocating device memory");
      held->ptrs.push_back(held->result);
      // No producer event covers this one: its fill is waited for here.
      void* filled = nullptr;
      lib.Check(lib.record_event(held->device, stream, &filled), "recording an event");
      const int e = lib.event_synchronize(filled);
      lib.event_destroy(filled);
      lib.Check(e, "waiting for the test's producer stream");
      return held->result;
    };
  }
  auto done = req.done;
  req.done = [held, done, host_out, dout, bytes](const Status& status) {
    Status st = status;
    const CudaLibrary& lib = *held->lib;
    if (st.ok()) {
      int e = 0;
      if (dout != nullptr && bytes) e = lib.test_fetch(held->device, host_out, dout, bytes);
      if (e == 0 && held->result != nullptr && held->result_bytes) {
        e = lib.test_fetch(held->device, held->result_host, held->result, held->result_bytes);
      }
      if (e != 0) {
        st = Status::Error(StatusCode::kUnavailable,
                           std::string("reading the result from the GPU failed: ") +
                               lib.error_string(e));
      }
    }
    // After an error, queued device work may still use the memory: it is
    // left allocated.
    if (st.ok()) {
      for (void* p : held->ptrs) lib.test_free(held->device, p);
    }
    done(st);
  };
}

std::string NcclLoneCommunicator(const std::vector<std::string>& wheel_dirs, int size,
                                 int timeout_ms) {
  std::string why;
  const NcclLibrary* lib = NcclLibrary::Load(wheel_dirs, &why);
  if (lib == nullptr) throw std::invalid_argument("NCCL cannot be loaded: " + why);
  NcclBootstrap alone;
  alone.publish = [](const std::string&) {};
  alone.fetch = [](std::chrono::milliseconds, std::string*) { return false; };
  try {
    NcclComm comm(*lib, 0, size, alone, std::chrono::milliseconds(timeout_ms),
                  "a test communicator");
    return "created: NCCL counts " + std::to_string(comm.count()) + " rank(s)";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace perseus
