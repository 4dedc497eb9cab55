#include "cc/core/shared_library.h"

#include <dlfcn.h>

namespace perseus {

SharedLibrary::SharedLibrary(const std::string& path, bool no_load) : path_(path) {
  handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | (no_load ? RTLD_NOLOAD : 0));
  if (handle_ == nullptr) {
    const char* err = dlerror();
    error_ = err != nullptr ? err : "cannot open " + path;
  }
}

void* SharedLibrary::Symbol(const char* name) {
  void* symbol = handle_ != nullptr ? dlsym(handle_, name) : nullptr;
  if (symbol == nullptr) missing_ += (missing_.empty() ? "" : ", ") + std::string(name);
  return symbol;
}

void SharedLibrary::Close() {
  if (handle_ != nullptr) dlclose(handle_);
  handle_ = nullptr;
}

}  // namespace perseus
