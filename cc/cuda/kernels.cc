// The kernels of kernels.cu (embedded as kernel_source.cc): compiled by NVRTC for the context's GPU,
// cached on disk, loaded once per context, and launched through the driver
// API (kernels.h).
#include "cc/cuda/kernels.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "cc/cuda/driver.h"
#include "cc/cuda/kernel_list.h"

namespace perseus {

extern const char kKernelSource[];

namespace {

// The kernels of kernel_list.h, in its order.
enum Kernel {
#define PTF_KERNEL_ENUM(name, function, synchronising) k##name,
  PERSEUS_CUDA_KERNELS(PTF_KERNEL_ENUM)
#undef PTF_KERNEL_ENUM
  kKernelCount
};

const char* const kKernelNames[] = {
#define PTF_KERNEL_NAME(name, function, synchronising) #function,
    PERSEUS_CUDA_KERNELS(PTF_KERNEL_NAME)
#undef PTF_KERNEL_NAME
};

constexpr unsigned kThreads = 256;
constexpr unsigned kScanBlocks = 1024;

unsigned Blocks(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > 4096) b = 4096;
  return static_cast<unsigned>(b);
}

constexpr const char* kCompileFlags = "--fmad=false";

size_t Align(size_t b) { return (b + 255) / 256 * 256; }

std::mutex g_mu;
std::string g_last_failure;  // why the kernels are not ready (kKernelsUnavailable)

const cu::Driver& DriverOrThrow() {
  std::string why;
  const cu::Driver* d = cu::Driver::Get(&why);
  if (d == nullptr) throw std::runtime_error(why);
  return *d;
}

const cu::Nvrtc& NvrtcOrThrow() {
  std::string why;
  const cu::Nvrtc* n = cu::Nvrtc::Get(&why);
  if (n == nullptr) throw std::runtime_error(why);
  return *n;
}

// NVRTC's output for `arch`: a cubin for "sm_NN", PTX (NUL-terminated) for
// "compute_NN".
std::string Compile(const cu::Nvrtc& nv, const std::string& arch) {
  cu::Nvrtc::Program prog = nullptr;
  int r = nv.CreateProgram(&prog, kKernelSource, "perseus_kernels.cu", 0, nullptr, nullptr);
  if (r != 0) {
    throw std::runtime_error(std::string("NVRTC could not take the kernels' source: ") +
                             nv.GetErrorString(r));
  }
  // --fmad=false: a product and a sum stay two roundings, as on the host
  // (top-k's grad * prescale + residual gives the host's bits).
  const std::string option = "--gpu-architecture=" + arch;
  const char* options[] = {option.c_str(), kCompileFlags};
  r = nv.CompileProgram(prog, 2, options);
  std::string out;
  if (r == 0) {
    const bool ptx = arch.compare(0, 8, "compute_") == 0;
    size_t size = 0;
    r = ptx ? nv.GetPTXSize(prog, &size) : nv.GetCUBINSize(prog, &size);
    out.resize(size);
    if (r == 0) r = ptx ? nv.GetPTX(prog, &out[0]) : nv.GetCUBIN(prog, &out[0]);
  } else {
    size_t size = 0;
    nv.GetProgramLogSize(prog, &size);
    std::string log(size, '\0');
    if (size) nv.GetProgramLog(prog, &log[0]);
    nv.DestroyProgram(&prog);
    throw std::runtime_error("NVRTC " + std::to_string(nv.major) + "." +
                             std::to_string(nv.minor) + " could not compile the kernels for " +
                             arch + ": " + nv.GetErrorString(r) + "\n" + log);
  }
  nv.DestroyProgram(&prog);
  if (r != 0 || out.empty()) {
    throw std::runtime_error("NVRTC gave no code for " + arch + ": " + nv.GetErrorString(r));
  }
  return out;
}

uint64_t Fnv1a(const std::string& text, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string CacheDir() {
  if (const char* env = std::getenv("PERSEUS_KERNEL_CACHE")) return env;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg) {
    return std::string(xdg) + "/perseus_tf/kernels";
  }
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr && *home ? home : "/tmp") + "/.cache/perseus_tf/kernels";
}

void MakeDirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') mkdir(path.substr(0, i).c_str(), 0755);
  }
}

// The code for `arch`, from the cache when a file for this source, arch and
// NVRTC version is there (unless `fresh`), else compiled and written there
// (atomically; a cache that cannot be written only costs a compile per
// process).
std::string CodeFor(const cu::Nvrtc& nv, const std::string& arch, bool fresh = false) {
  const std::string key = std::string(kKernelSource) + "|" + kCompileFlags + "|" + arch + "|" +
                          std::to_string(nv.major) + "." + std::to_string(nv.minor) + "|" +
                          nv.path;
  char name[64];
  std::snprintf(name, sizeof(name), "%016llx-%s.bin",
                static_cast<unsigned long long>(Fnv1a(key)), arch.c_str());
  const std::string dir = CacheDir();
  const std::string path = dir + "/" + name;
  if (!fresh) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      if (!ss.str().empty()) return ss.str();
    }
  }
  std::string code = Compile(nv, arch);
  MakeDirs(dir);
  const std::string partial = path + ".partial." + std::to_string(getpid());
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (out) out.write(code.data(), static_cast<std::streamsize>(code.size()));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) std::remove(partial.c_str());
  return code;
}

// Which code the GPU of `device` takes: machine code for its own
// architecture when NVRTC has it, else PTX of NVRTC's newest (the driver
// compiles it for a newer GPU).
std::string ArchFor(const cu::Driver& d, const cu::Nvrtc& nv, cu::Device device) {
  int major = 0, minor = 0;
  d.DeviceGetAttribute(&major, cu::kAttrComputeMajor, device);
  d.DeviceGetAttribute(&minor, cu::kAttrComputeMinor, device);
  const int cc = major * 10 + minor;
  int newest = 0, oldest = 1 << 30;
  for (int a : nv.archs) {
    if (a == cc) return "sm_" + std::to_string(cc);
    if (a > newest) newest = a;
    if (a < oldest) oldest = a;
  }
  if (newest != 0 && cc > newest) return "compute_" + std::to_string(newest);
  throw std::runtime_error("GPU " + std::to_string(device) + " has compute capability " +
                           std::to_string(major) + "." + std::to_string(minor) + ", which NVRTC " +
                           std::to_string(nv.major) + "." + std::to_string(nv.minor) +
                           " does not compile for (it knows " + std::to_string(oldest) + " to " +
                           std::to_string(newest) + ")");
}

struct Loaded {
  cu::Function f[kKernelCount] = {};
};

std::map<cu::Context, Loaded>& Modules() {
  static auto* m = new std::map<cu::Context, Loaded>();
  return *m;
}

// The calling thread's current context: the caller made the device of the
// data current (the plane does before every launch). None current is an
// error, not device 0's: on a machine of several GPUs that would launch on
// the wrong one.
cu::Context CurrentContext(const cu::Driver& d) {
  cu::Context ctx = nullptr;
  d.CtxGetCurrent(&ctx);
  if (ctx != nullptr) return ctx;
  throw std::runtime_error(
      "no CUDA context is current on this thread: the kernels run on the device whose context "
      "the caller made current (an internal error of Perseus-TF; please report it)");
}

const Loaded& KernelsForCurrent() {
  const cu::Driver& d = DriverOrThrow();
  const cu::Context ctx = CurrentContext(d);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = Modules().find(ctx);
  if (it != Modules().end()) return it->second;
  const cu::Nvrtc& nv = NvrtcOrThrow();
  cu::Device device = 0;
  d.CtxGetDevice(&device);
  const std::string arch = ArchFor(d, nv, device);
  std::string code = CodeFor(nv, arch);
  cu::Module module = nullptr;
  cu::Result r = d.ModuleLoadData(&module, code.data());
  if (r != cu::kSuccess) {
    // A cached file the driver refuses (damaged, or from elsewhere): compiled
    // afresh, and the cache entry replaced.
    code = CodeFor(nv, arch, /*fresh=*/true);
    r = d.ModuleLoadData(&module, code.data());
  }
  if (r != cu::kSuccess) {
    throw std::runtime_error("the CUDA driver could not load the kernels compiled for " + arch +
                             " by NVRTC " + std::to_string(nv.major) + "." +
                             std::to_string(nv.minor) + ": " + d.Describe(r) +
                             " (a driver older than that NVRTC? PTX needs a driver at least as "
                             "new as the NVRTC that made it)");
  }
  Loaded loaded;
  for (int k = 0; k < kKernelCount; ++k) {
    r = d.ModuleGetFunction(&loaded.f[k], module, kKernelNames[k]);
    if (r != cu::kSuccess) {
      throw std::runtime_error(std::string("kernel ") + kKernelNames[k] + " is missing: " +
                               d.Describe(r));
    }
  }
  return Modules().emplace(ctx, loaded).first->second;
}

// Launches kernel k with `args` (pointers to each argument, of the kernel's
// exact parameter types); a CUresult, or kKernelsUnavailable.
int Launch(Kernel k, unsigned grid, unsigned block, void* stream,
           std::initializer_list<const void*> args) {
  const Loaded* loaded = nullptr;
  try {
    loaded = &KernelsForCurrent();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_last_failure = e.what();
    return kKernelsUnavailable;
  }
  std::vector<void*> params;
  for (const void* a : args) params.push_back(const_cast<void*>(a));
  return cu::Driver::Get(nullptr)->LaunchKernel(loaded->f[k], grid, 1, 1, block, 1, 1, 0,
                                                static_cast<cu::Stream>(stream), params.data(),
                                                nullptr);
}

// The scan's split: blocks of about kScanSpan elements (at most kScanBlocks
// blocks), each scanned in tiles of kThreads.
constexpr size_t kScanSpan = 4096;
size_t ScanPerBlock(size_t n, unsigned* blocks) {
  size_t b = (n + kScanSpan - 1) / kScanSpan;
  if (b < 1) b = 1;
  if (b > kScanBlocks) b = kScanBlocks;
  *blocks = static_cast<unsigned>(b);
  return (n + b - 1) / b;
}

}  // namespace

void EnsureKernels() { KernelsForCurrent(); }

std::string KernelsUnavailableReason() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_last_failure;
}

}  // namespace perseus

using perseus::Launch;

extern "C" {

int perseus_cuda_to_half(const float* in, uint16_t* out, size_t n, float scale, void* stream) {
  if (n == 0) return 0;
  const uint64_t count = n;
  return Launch(perseus::kToHalf, perseus::Blocks(n), perseus::kThreads, stream,
                {&in, &out, &count, &scale});
}

int perseus_cuda_from_half(const uint16_t* in, float* out, size_t n, float scale, void* stream) {
  if (n == 0) return 0;
  const uint64_t count = n;
  return Launch(perseus::kFromHalf, perseus::Blocks(n), perseus::kThreads, stream,
                {&in, &out, &count, &scale});
}

int perseus_cuda_scale(void* data, int dtype, size_t n, double factor, void* stream) {
  if (n == 0 || factor == 1.0) return 0;
  static const perseus::Kernel kByDtype[] = {
      perseus::kScaleF16, perseus::kScaleBf16, perseus::kScaleF32, perseus::kScaleF64,
      perseus::kScaleI32, perseus::kScaleI64,  perseus::kScaleU8,  perseus::kScaleI8,
      perseus::kKernelCount /* bool */,        perseus::kScaleU16, perseus::kScaleI16};
  if (dtype < 0 || dtype > 10) return perseus::cu::kInvalidValue;
  if (dtype == 8) return 0;  // bool: as on the host, scaling leaves it
  const uint64_t count = n;
  const float f32 = static_cast<float>(factor);
  const void* f = dtype == 2 ? static_cast<const void*>(&f32) : &factor;
  return Launch(kByDtype[dtype], perseus::Blocks(n), perseus::kThreads, stream,
                {&data, &count, f});
}

int perseus_cuda_sum_chunks(const float* const* in, int chunks, float* out, size_t n,
                            void* stream) {
  if (chunks < 1) return perseus::cu::kInvalidValue;
  if (n == 0) return 0;
  const uint64_t count = n;
  return Launch(perseus::kSumChunks, perseus::Blocks(n), perseus::kThreads, stream,
                {&in, &chunks, &out, &count});
}

int perseus_cuda_nonfinite(const void* data, int kind, size_t n, int* flag, void* stream) {
  if (n == 0) return 0;
  const uint64_t count = n;
  const unsigned grid = perseus::Blocks(n), block = perseus::kThreads;
  switch (kind) {
    case 0: return Launch(perseus::kNonFiniteF32, grid, block, stream, {&data, &count, &flag});
    case 2: return Launch(perseus::kNonFiniteF64, grid, block, stream, {&data, &count, &flag});
    case 1:
    case 3: {
      const uint32_t mask = kind == 1 ? 0x7c00u : 0x7f80u;
      return Launch(perseus::kNonFinite16, grid, block, stream, {&data, &count, &mask, &flag});
    }
    default: return perseus::cu::kInvalidValue;
  }
}

int perseus_cuda_batched_copy(const uint64_t* spans, int count, void* stream) {
  if (count <= 0) return 0;
  // At least 512 blocks, so that a few large spans are shared among them.
  const int grid = count >= 1024 ? 1024 : (count > 512 ? count : 512);
  return Launch(perseus::kBatchedCopy, grid, perseus::kThreads, stream,
                {&spans, &count});
}

size_t perseus_cuda_scan_scratch_bytes(size_t) {
  return perseus::Align(4 * perseus::kScanBlocks);
}

int perseus_cuda_exclusive_sum(const uint32_t* in, uint32_t* out, size_t n, void* scratch,
                               void* stream) {
  if (n == 0) return 0;
  unsigned blocks = 0;
  const uint64_t per_block = perseus::ScanPerBlock(n, &blocks);
  const uint64_t count = n;
  const int nblocks = static_cast<int>(blocks);
  int r = Launch(perseus::kScanBlockSums, blocks, perseus::kThreads, stream,
                 {&in, &count, &per_block, &scratch});
  if (r == 0) r = Launch(perseus::kScanOffsets, 1, 1, stream, {&scratch, &nblocks});
  if (r == 0) {
    r = Launch(perseus::kScanApply, blocks, perseus::kThreads, stream,
               {&in, &out, &count, &per_block, &scratch});
  }
  return r;
}

size_t perseus_cuda_topk_scratch_bytes(size_t n) {
  // acc, key, equal, equal_rank, chosen, position (4 bytes each per
  // element), the threshold pair, and the scans' block sums.
  return 6 * perseus::Align(4 * (n ? n : 1)) + 256 + perseus_cuda_scan_scratch_bytes(n);
}

int perseus_cuda_topk(const float* grad, float* residual, size_t n, size_t k, float prescale,
                      int32_t* out_index, float* out_value, void* scratch, void* stream) {
  if (n == 0 || k == 0) return 0;
  if (k > n) return perseus::cu::kInvalidValue;
  char* p = static_cast<char*>(scratch);
  const size_t slab = perseus::Align(4 * n);
  float* acc = reinterpret_cast<float*>(p);
  uint32_t* key = reinterpret_cast<uint32_t*>(p + slab);
  uint32_t* equal = reinterpret_cast<uint32_t*>(p + 2 * slab);
  uint32_t* equal_rank = reinterpret_cast<uint32_t*>(p + 3 * slab);
  uint32_t* chosen = reinterpret_cast<uint32_t*>(p + 4 * slab);
  uint32_t* position = reinterpret_cast<uint32_t*>(p + 5 * slab);
  uint32_t* threshold = reinterpret_cast<uint32_t*>(p + 6 * slab);
  void* sums = p + 6 * slab + 256;
  const uint64_t count = n, top = k;
  const unsigned grid = perseus::Blocks(n), block = perseus::kThreads;
  int r = Launch(perseus::kTopkKeys, grid, block, stream,
                 {&grad, &residual, &count, &prescale, &acc, &key});
  if (r == 0) r = Launch(perseus::kTopkThreshold, 1, 1024, stream, {&key, &count, &top,
                                                                    &threshold});
  if (r == 0) r = Launch(perseus::kTopkEqualFlags, grid, block, stream,
                         {&key, &count, &threshold, &equal});
  if (r == 0) r = perseus_cuda_exclusive_sum(equal, equal_rank, n, sums, stream);
  if (r == 0) r = Launch(perseus::kTopkChosenFlags, grid, block, stream,
                         {&key, &count, &top, &threshold, &equal_rank, &chosen});
  if (r == 0) r = perseus_cuda_exclusive_sum(chosen, position, n, sums, stream);
  if (r == 0) r = Launch(perseus::kTopkWrite, grid, block, stream,
                         {&acc, &count, &chosen, &position, &residual, &out_index, &out_value});
  return r;
}

int perseus_cuda_spin(long long cycles, void* stream) {
  return Launch(perseus::kSpin, 1, 1, stream, {&cycles});
}

int perseus_cuda_compile_to_file(const char* arch, const char* path, char* error,
                                 size_t error_len) {
  try {
    const std::string code = perseus::Compile(perseus::NvrtcOrThrow(), arch);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(code.data(), static_cast<std::streamsize>(code.size()));
    if (!out) throw std::runtime_error(std::string("cannot write ") + path);
    return 0;
  } catch (const std::exception& e) {
    if (error && error_len) std::snprintf(error, error_len, "%s", e.what());
    return 1;
  }
}

int perseus_cuda_nvrtc_info(char* out, size_t out_len) {
  std::string why;
  const perseus::cu::Nvrtc* nv = perseus::cu::Nvrtc::Get(&why);
  std::string text = why;
  if (nv != nullptr) {
    text = std::to_string(nv->major) + "." + std::to_string(nv->minor) + ":";
    for (int a : nv->archs) text += " " + std::to_string(a);
    text += " (" + nv->path + ")";
  }
  if (out && out_len) std::snprintf(out, out_len, "%s", text.c_str());
  return nv != nullptr ? 0 : 1;
}

}  // extern "C"
