// Test-only: running the _core collectives through the simulated device.
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

#include "cc/runtime/request.h"

namespace perseus {

// Whether PERSEUS_TEST_DEVICE asks for the simulated device ("sim"); unset
// or empty means host memory. Throws std::invalid_argument for other values.
bool SimDeviceRequested();

// Moves req (whose input is host memory, and whose output is host_out, or
// null when it allocates its result) to the simulated device.
void PlaceOnSimDevice(Request& req, void* host_out);

}  // namespace perseus
