#include "cc/cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <type_traits>

namespace perseus {
namespace cu {
namespace {

// Resolves every named call of `handle` into its slot; false with the first
// missing name in *missing.
template <typename T>
void Resolve(void* handle, const char* name, T* slot, std::string* missing) {
  *slot = reinterpret_cast<T>(dlsym(handle, name));
  if (*slot == nullptr && missing->empty()) *missing = name;
}

const Driver* OpenDriver(std::string* why_not) {
  const char* env = std::getenv("PERSEUS_CUDA_DRIVER");
  const std::string path = env != nullptr && *env ? env : "libcuda.so.1";
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* err = dlerror();
    *why_not = "the CUDA driver (" + path + ", part of the NVIDIA driver) cannot be loaded: " +
               (err ? err : "unknown error");
    return nullptr;
  }
  auto* d = new Driver();
  d->path = path;
  std::string missing;
#define PTF_RESOLVE(field, api, symbol) Resolve(h, symbol, &d->field, &missing);
  PTF_CUDA_DRIVER_CALLS(PTF_RESOLVE)
#undef PTF_RESOLVE
  if (!missing.empty()) {
    *why_not = path + " lacks " + missing + ": the NVIDIA driver is older than CUDA 11.2's " +
               "(Perseus needs 525 or later)";
    return nullptr;  // the handle stays open: a process loads it once
  }
  const Result r = d->Init(0);
  if (r != kSuccess) {
    *why_not = "no CUDA device is usable here (cuInit: " + d->Describe(r) + ")";
    return nullptr;
  }
  return d;
}

std::string Dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

const Nvrtc* OpenNvrtc(std::string* why_not) {
  std::vector<std::string> tried;
  const char* env = std::getenv("PERSEUS_NVRTC_LIBRARY");
  if (env != nullptr && *env) {
    tried.push_back(env);
  } else {
    // Beside this library when installed next to TF's CUDA wheels
    // (site-packages/nvidia/cuda_nvrtc/lib), then the loader's path.
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&OpenNvrtc), &info) != 0 && info.dli_fname != nullptr) {
      tried.push_back(Dir(info.dli_fname) + "../nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
    }
    for (const char* name : {"libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"}) {
      tried.push_back(name);
    }
  }
  std::string errors;
  for (const std::string& path : tried) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* err = dlerror();
      errors += (errors.empty() ? "" : "; ") + std::string(err ? err : path.c_str());
      continue;
    }
    auto* n = new Nvrtc();
    n->path = path;
    std::string missing;
#define PTF_RESOLVE(field, api, symbol) Resolve(h, symbol, &n->field, &missing);
    PTF_NVRTC_CALLS(PTF_RESOLVE)
#undef PTF_RESOLVE
    if (!missing.empty()) {
      errors += (errors.empty() ? "" : "; ") + path + " lacks " + missing +
                " (NVRTC older than CUDA 11.2)";
      delete n;
      continue;
    }
    n->Version(&n->major, &n->minor);
    int count = 0;
    if (n->GetNumSupportedArchs(&count) == 0 && count > 0) {
      n->archs.resize(static_cast<size_t>(count));
      n->GetSupportedArchs(n->archs.data());
    }
    return n;
  }
  *why_not = "NVRTC, which compiles Perseus's CUDA kernels for this GPU, cannot be loaded (" +
             errors + "); install nvidia-cuda-nvrtc-cu12 (it comes with tensorflow[and-cuda]) " +
             "or name the library in PERSEUS_NVRTC_LIBRARY";
  return nullptr;
}

}  // namespace

const Driver* Driver::Get(std::string* why_not) {
  static std::once_flag once;
  static const Driver* driver = nullptr;
  static std::string reason;
  std::call_once(once, [] { driver = OpenDriver(&reason); });
  if (driver == nullptr && why_not != nullptr) *why_not = reason;
  return driver;
}

std::string Driver::Describe(Result r) const {
  const char* text = nullptr;
  if (GetErrorString == nullptr || GetErrorString(r, &text) != kSuccess || text == nullptr) {
    return "CUDA error " + std::to_string(r);
  }
  return std::string(text) + " (" + std::to_string(r) + ")";
}

const Nvrtc* Nvrtc::Get(std::string* why_not) {
  static std::once_flag once;
  static const Nvrtc* nvrtc = nullptr;
  static std::string reason;
  std::call_once(once, [] { nvrtc = OpenNvrtc(&reason); });
  if (nvrtc == nullptr && why_not != nullptr) *why_not = reason;
  return nvrtc;
}

}  // namespace cu
}  // namespace perseus
