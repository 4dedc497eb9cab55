#include "cc/python/testing/sim_requests.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/device/sim_device.h"

namespace perseus {
namespace {

// The device memory one request holds until it completes.
struct Held {
  std::vector<void*> ptrs;
  void* result = nullptr;       // an allocated result on the device
  void* result_host = nullptr;  // and where the caller wants it
  size_t result_bytes = 0;
};

int ProducerStream() {
  static const int stream = SimDevice::Get().CreateStream();
  return stream;
}

}  // namespace

TestDevice RequestedTestDevice() {
  const char* v = std::getenv("PERSEUS_TEST_DEVICE");
  if (v == nullptr || *v == '\0') return TestDevice::kNone;
  if (std::string(v) == "sim") return TestDevice::kSim;
  if (std::string(v) == "cuda") return TestDevice::kCuda;
  throw std::invalid_argument(std::string("PERSEUS_TEST_DEVICE=") + v +
                              " is not valid: use sim (the simulated device), cuda (a GPU) or "
                              "leave it unset");
}

void PlaceOnTestDevice(Request& req, void* host_out) {
  switch (RequestedTestDevice()) {
    case TestDevice::kSim: return PlaceOnSimDevice(req, host_out);
    case TestDevice::kCuda: return PlaceOnCudaDevice(req, host_out);
    case TestDevice::kNone: return;
  }
}

void PlaceOnSimDevice(Request& req, void* host_out) {
  SimDevice& sim = SimDevice::Get();
  const int producer = ProducerStream();
  auto held = std::make_shared<Held>();
  const size_t esize = DataTypeSize(req.meta.dtype);
  const size_t bytes = static_cast<size_t>(NumElements(req.meta.shape)) * esize;
  const void* host_in = req.input;
  void* din = sim.Alloc(bytes);
  held->ptrs.push_back(din);
  auto copy = std::make_shared<std::vector<char>>(static_cast<const char*>(host_in),
                                                  static_cast<const char*>(host_in) + bytes);
  sim.Launch(producer, "the producer writes the input", {}, {{din, bytes}},
             [din, copy] { std::memcpy(din, copy->data(), copy->size()); });
  req.where.kind = MemoryKind::kSimulated;
  req.where.device = 0;
  req.where.stream = reinterpret_cast<void*>(static_cast<intptr_t>(producer));
  req.where.ready = sim.Record(producer);
  req.input = din;
  void* dout = nullptr;
  if (host_out != nullptr) {
    dout = host_out == host_in ? din : sim.Alloc(bytes);
    if (dout != din) held->ptrs.push_back(dout);
    req.output = dout;
  }
  if (req.allocate) {
    auto host_allocate = req.allocate;
    req.allocate = [held, host_allocate, esize](const std::vector<int64_t>& shape) -> void* {
      held->result_bytes = static_cast<size_t>(NumElements(shape)) * esize;
      held->result_host = host_allocate(shape);
      held->result = SimDevice::Get().Alloc(held->result_bytes);
      held->ptrs.push_back(held->result);
      return held->result;
    };
  }
  auto done = req.done;
  req.done = [held, done, host_out, dout, bytes](const Status& status) {
    Status st = status;
    SimDevice& dev = SimDevice::Get();
    if (st.ok()) {
      if (dout != nullptr) {
        dev.HostRead(dout, bytes, "the caller reads the result");
        if (bytes) std::memcpy(host_out, dout, bytes);
      }
      if (held->result != nullptr) {
        dev.HostRead(held->result, held->result_bytes, "the caller reads the result");
        if (held->result_bytes) std::memcpy(held->result_host, held->result, held->result_bytes);
      }
    }
    std::vector<std::string> hazards = dev.TakeHazards();
    if (!hazards.empty()) {
      st = Status::Error(StatusCode::kUnavailable,
                         hazards[0] + (hazards.size() > 1 ? " (and " +
                                                                std::to_string(hazards.size() - 1) +
                                                                " more)"
                                                          : std::string()));
    }
    // After an error or a hazard, queued device work may still use the
    // memory: it is left allocated.
    if (st.ok()) {
      for (void* p : held->ptrs) dev.Free(p);
    }
    done(st);
  };
}

}  // namespace perseus
