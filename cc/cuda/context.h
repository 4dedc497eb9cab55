// What the CUDA plane (cuda_plane.cc) and the library's C calls
// (cuda_calls.cc) share: the driver, and the devices' primary contexts.
#pragma once

#include "cc/cuda/driver.h"

namespace perseus {

// The process's driver; only called once Driver::Get succeeded.
const cu::Driver& D();
inline cu::DevicePtr DP(const void* p) { return reinterpret_cast<cu::DevicePtr>(p); }

// Device `device`'s primary context (the one TF and the CUDA runtime use;
// retained once, kept for the process) made current on the calling thread.
cu::Result UseDevice(int device);

// Events of device `device` (timing off) from a pool: one is created only
// when none is free, so that steady training creates none. TakeEvent needs
// the device's context current; GiveEvent takes back an event once nothing
// will query, wait for or record it again (events not from the pool are
// destroyed).
cu::Result TakeEvent(int device, cu::Event* out);
void GiveEvent(cu::Event event);

}  // namespace perseus
