#include "cc/cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "cc/core/shared_library.h"

namespace perseus {
namespace cu {
namespace {

const Driver* OpenDriver(std::string* why_not) {
  const char* env = std::getenv("PERSEUS_CUDA_DRIVER");
  const std::string path = env != nullptr && *env ? env : "libcuda.so.1";
  SharedLibrary lib(path);
  if (!lib.ok()) {
    *why_not = "the CUDA driver (" + path + ", part of the NVIDIA driver) cannot be loaded: " +
               lib.error();
    return nullptr;
  }
  auto* d = new Driver();
  d->path = path;
#define PTF_RESOLVE(field, api, symbol) lib.Find(symbol, &d->field);
  PTF_CUDA_DRIVER_CALLS(PTF_RESOLVE)
#undef PTF_RESOLVE
  if (!lib.missing().empty()) {
    *why_not = path + " lacks " + lib.missing() + ": the NVIDIA driver is older than CUDA " +
               "11.2's (Perseus needs 525 or later)";
    delete d;
    return nullptr;  // the library stays open: a process loads it once
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
    SharedLibrary lib(path);
    if (!lib.ok()) {
      errors += (errors.empty() ? "" : "; ") + lib.error();
      continue;
    }
    auto* n = new Nvrtc();
    n->path = path;
#define PTF_RESOLVE(field, api, symbol) lib.Find(symbol, &n->field);
    PTF_NVRTC_CALLS(PTF_RESOLVE)
#undef PTF_RESOLVE
    if (!lib.missing().empty()) {
      errors += (errors.empty() ? "" : "; ") + path + " lacks " + lib.missing() +
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

const Driver* Driver::Get(std::string* why_not) { return LoadOnce<Driver, OpenDriver>(why_not); }

std::string Driver::Describe(Result r) const {
  const char* text = nullptr;
  if (GetErrorString == nullptr || GetErrorString(r, &text) != kSuccess || text == nullptr) {
    return "CUDA error " + std::to_string(r);
  }
  return std::string(text) + " (" + std::to_string(r) + ")";
}

const Nvrtc* Nvrtc::Get(std::string* why_not) { return LoadOnce<Nvrtc, OpenNvrtc>(why_not); }

}  // namespace cu
}  // namespace perseus
