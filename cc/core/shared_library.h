// A shared library opened at run time (dlopen) and the functions found in
// it, and the load-once rule every such library follows: the CUDA driver
// and NVRTC (cc/cuda/driver.cc), NCCL (cc/transport/nccl.cc) and
// libperseus_cuda.so (cc/device/cuda_library.cc) are each opened at most
// once per process, and a failure's reason is kept and given to every
// later caller.
#pragma once

#include <mutex>
#include <string>

namespace perseus {

class SharedLibrary {
 public:
  // Opens `path` (RTLD_NOW | RTLD_LOCAL); `no_load`: only if the process
  // has it loaded already. ok() is false when it did not open, and error()
  // then says why (the loader's words).
  explicit SharedLibrary(const std::string& path, bool no_load = false);

  bool ok() const { return handle_ != nullptr; }
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

  // *slot = the function `name`, or null when the library lacks it (then
  // its name is added to missing()).
  template <typename F>
  bool Find(const char* name, F* slot) {
    void* symbol = Symbol(name);
    *slot = reinterpret_cast<F>(symbol);
    return symbol != nullptr;
  }
  // The names Find did not find, comma-separated ("" when none).
  const std::string& missing() const { return missing_; }

  // Closes it (a library that failed its checks); a library that passed
  // stays open for the process's life.
  void Close();

 private:
  void* Symbol(const char* name);

  void* handle_ = nullptr;
  std::string path_, error_, missing_;
};

// Open(&why) once per process: every call returns the first call's result
// (null with *why_not set to the same reason when it failed).
template <typename T, const T* (*Open)(std::string*)>
const T* LoadOnce(std::string* why_not) {
  static std::once_flag once;
  static const T* loaded = nullptr;
  static std::string reason;
  std::call_once(once, [] { loaded = Open(&reason); });
  if (loaded == nullptr && why_not != nullptr) *why_not = reason;
  return loaded;
}

}  // namespace perseus
