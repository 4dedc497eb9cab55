#include "cc/device/cuda_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <type_traits>

#include "cc/core/shared_library.h"

namespace perseus {
namespace {

std::string DefaultPath() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&MakeCudaPlane), &info) == 0 || info.dli_fname == nullptr) {
    return "libperseus_cuda.so";
  }
  std::string self = info.dli_fname;
  const size_t slash = self.rfind('/');
  return (slash == std::string::npos ? std::string() : self.substr(0, slash + 1)) +
         "libperseus_cuda.so";
}

const CudaLibrary* Open(std::string* why_not) {
  const char* env = std::getenv("PERSEUS_CUDA_LIBRARY");
  const std::string path = env != nullptr && *env ? env : DefaultPath();
  SharedLibrary handle(path);
  if (!handle.ok()) {
    *why_not = "cannot open " + path + " (" + handle.error() +
               "): it holds Perseus's CUDA code and `pip install` builds it beside "
               "libperseus_core.so (reinstall Perseus-TF); PERSEUS_CUDA_LIBRARY names another "
               "path";
    return nullptr;
  }
  auto* lib = new CudaLibrary();
  lib->path = path;
  auto get = [&](auto& fn, const char* name) { handle.Find(name, &fn); };
  get(lib->plane_create, "perseus_cuda_plane_create");
  get(lib->device_count, "perseus_cuda_device_count");
  get(lib->error_string, "perseus_cuda_error_string");
  get(lib->test_alloc, "perseus_cuda_test_alloc");
  get(lib->test_free, "perseus_cuda_test_free");
  get(lib->test_produce, "perseus_cuda_test_produce");
  get(lib->test_fetch, "perseus_cuda_test_fetch");
  get(lib->event_destroy, "perseus_cuda_event_destroy");
  get(lib->record_event, "perseus_cuda_record_event");
  get(lib->event_synchronize, "perseus_cuda_event_synchronize");
  if (!handle.missing().empty()) {
    *why_not = path + " lacks " + handle.missing() +
               ": it is from another version of Perseus; rebuild it";
    delete lib;
    return nullptr;  // the library stays open: a process loads it once
  }
  return lib;
}

}  // namespace

const CudaLibrary* CudaLibrary::Load(std::string* why_not) {
  return LoadOnce<CudaLibrary, Open>(why_not);
}

void CudaLibrary::Check(int code, const std::string& what) const {
  if (code != 0) {
    throw std::runtime_error("CUDA error in " + what + ": " + error_string(code) + " (" +
                             std::to_string(code) + ")");
  }
}

std::unique_ptr<DataPlane> MakeCudaPlane(int device, int streams) {
  std::string why;
  const CudaLibrary* lib = CudaLibrary::Load(&why);
  if (lib == nullptr) throw std::runtime_error("a tensor on CUDA device " +
                                               std::to_string(device) + " needs CUDA: " + why);
  char error[512] = {0};
  void* plane = lib->plane_create(device, streams, error, sizeof(error));
  if (plane == nullptr) {
    throw std::runtime_error("cannot use CUDA device " + std::to_string(device) + ": " + error);
  }
  return std::unique_ptr<DataPlane>(static_cast<DataPlane*>(plane));
}

}  // namespace perseus
