// libperseus_cuda.so, opened at run time: the CUDA data plane and the CUDA
// calls tests need (cc/cuda/cuda_plane.h). libperseus_core.so links no CUDA,
// so the import and every host path work on machines without it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "cc/device/data_plane.h"

namespace perseus {

struct CudaLibrary {
  void* (*plane_create)(int, int, char*, size_t) = nullptr;
  int (*device_count)(int*) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*test_alloc)(int, size_t, void**) = nullptr;
  int (*test_free)(int, void*) = nullptr;
  int (*test_produce)(int, void*, const void*, size_t, int, void**, void**) = nullptr;
  int (*test_fetch)(int, void*, const void*, size_t) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  int (*record_event)(int, void*, void**) = nullptr;
  int (*event_synchronize)(void*) = nullptr;
  std::string path;

  // PERSEUS_CUDA_LIBRARY, else libperseus_cuda.so beside libperseus_core.so.
  // Loaded once; null with the reason (where it looked, what failed).
  static const CudaLibrary* Load(std::string* why_not);
  // Throws std::runtime_error naming the call and CUDA's message when
  // `code` is not 0.
  void Check(int code, const std::string& what) const;
};

// The plane of CUDA device `device` with `streams` streams; throws
// std::runtime_error saying why there is none (no library, no device).
std::unique_ptr<DataPlane> MakeCudaPlane(int device, int streams);

}  // namespace perseus
