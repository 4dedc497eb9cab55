// The CUDA data plane (cuda_plane.cc) and what tests need of CUDA, behind
// a C interface in libperseus_cuda.so (built by the host compiler; CUDA's
// driver and NVRTC are opened at run time, cc/cuda/driver.h). libperseus_core.so
// does not link CUDA: it opens that library when the first request placed on
// a CUDA device arrives (cc/device/cuda_library.h) and finds these by name.
#pragma once

#include <cstddef>

extern "C" {

// A perseus::DataPlane (cc/device/data_plane.h) for CUDA device `device`
// with `streams` streams of its own; deleted through its virtual
// destructor. Null on failure, with the reason in error (error_len bytes).
void* perseus_cuda_plane_create(int device, int streams, char* error, size_t error_len);

// How many CUDA devices this process sees; a CUresult (0: fine).
int perseus_cuda_device_count(int* count);
const char* perseus_cuda_error_string(int code);

// For tests (PERSEUS_TEST_DEVICE=cuda), each a CUresult:
// device memory of `bytes` (filled with 0xff bytes: NaN as floats);
int perseus_cuda_test_alloc(int device, size_t bytes, void** out);
int perseus_cuda_test_free(int device, void* ptr);
// the host bytes written into dst the way a TF kernel's producer would:
// on a stream of the test's own (*stream), after a busy wait of `delay_us`
// microseconds on the device, and an event (*event) recorded after the
// write. Whoever reads dst before the event fires reads 0xff bytes.
int perseus_cuda_test_produce(int device, void* dst, const void* host, size_t bytes,
                              int delay_us, void** stream, void** event);
// Synchronous copy of device memory to the host (the legacy stream, which
// does not wait for the plane's non-blocking streams: a result read before
// the runtime's work finished reads what was there before).
int perseus_cuda_test_fetch(int device, void* host, const void* src, size_t bytes);
int perseus_cuda_event_destroy(void* event);

// For TF's GPU kernels (cc/tf/op_kernels.cc), each a CUresult: an event
// recorded now on `stream` of `device` (a producer's cudaStream_t), and a
// host wait for one.
int perseus_cuda_record_event(int device, void* stream, void** event);
int perseus_cuda_event_synchronize(void* event);

}  // extern "C"
