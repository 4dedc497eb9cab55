// Test-only: running the _core collectives on a device.
//
// With PERSEUS_TEST_DEVICE=sim, every array submitted through _core is put
// on the simulated device (cc/device/sim_device.h) the way TF's GPU kernels
// hand tensors over: a producer stream writes the input there
// asynchronously and records an event, the request carries both, the
// runtime works on device memory, and the caller copies the result back
// only after the request completed. Any ordering hazard the device saw
// fails the request with the device's description. The multi-rank suites
// run once this way, so the ordering a GPU relies on is tested without one.
#pragma once

#include <string>
#include <vector>

#include "cc/runtime/request.h"

namespace perseus {

// With PERSEUS_TEST_DEVICE=cuda, the same on a real GPU (cuda_requests.cc):
// the producer's stream waits PERSEUS_TEST_CUDA_DELAY_US microseconds (20
// unless set) on the device before it writes the input, over memory that
// holds NaN until then, so a runtime that does not wait for the producer's
// event reduces NaN; and the result is read on CUDA's legacy stream, which
// does not wait for the runtime's streams, so a request completed before its
// device work returns stale bytes. PERSEUS_TEST_CUDA_DEVICE picks the GPU
// (0 unless set).
enum class TestDevice { kNone, kSim, kCuda };

// What PERSEUS_TEST_DEVICE asks for: unset or empty means host memory.
// Throws std::invalid_argument for other values.
TestDevice RequestedTestDevice();

// Moves req (whose input is host memory, and whose output is host_out, or
// null when it allocates its result) to the requested test device, if any.
void PlaceOnTestDevice(Request& req, void* host_out);

void PlaceOnSimDevice(Request& req, void* host_out);
void PlaceOnCudaDevice(Request& req, void* host_out);

// A NCCL communicator of `size` ranks that only this process joins, as rank
// 0: creation cannot finish, so it shows the deadline and the abort with the
// real library (tools/gpu_runtime_check.py). Returns the error, or what NCCL
// said of a communicator that did come up (size 1). Throws
// std::invalid_argument when NCCL cannot be loaded.
std::string NcclLoneCommunicator(const std::vector<std::string>& wheel_dirs, int size,
                                 int timeout_ms);

}  // namespace perseus
