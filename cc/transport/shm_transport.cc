#include "cc/transport/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>


#if defined(__x86_64__)
#include <immintrin.h>
#define PERSEUS_PAUSE() _mm_pause()
#else
#define PERSEUS_PAUSE() std::this_thread::yield()
#endif

namespace perseus {

namespace {

constexpr uint64_t kMagic = 0x5045525345555321ull;  // "PERSEUS!"
constexpr int kMaxRanks = 256;
constexpr size_t kHeaderBytes = 16384;
// Both sets of slots of one stream hold at most this much (all ranks).
constexpr size_t kSetBytes = size_t{4} << 20;

struct Header {
  uint64_t magic;
  uint64_t key;
  uint32_t size;
  uint32_t unused;
  uint64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> generation;
  std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<int32_t> aborted;  // world rank + 1 of a rank that failed
  alignas(64) int32_t pid[kMaxRanks];
  int32_t world[kMaxRanks];  // world rank of each local rank (for messages)
  alignas(64) std::atomic<uint64_t> entered[kMaxRanks];  // barriers each rank reached
};
static_assert(sizeof(Header) <= kHeaderBytes, "shared header too large");
static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

long Futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

// True when the process is gone (or a zombie nobody has reaped yet).
bool ProcessGone(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string line;
  std::getline(f, line);
  size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  char state = line[close + 2];
  return state == 'Z' || state == 'X';
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

struct ShmTransport::Segment {
  std::string name;
  void* base = nullptr;
  size_t bytes = 0;
  Header* header = nullptr;
  char* slots = nullptr;
  uint64_t passed = 0;  // barriers this rank entered
  int set = 0;          // which set of slots the next chunk uses

  ~Segment() {
    if (base) munmap(base, bytes);
  }
  // Creates (create=true) or opens the named segment and maps it.
  bool Map(bool create, size_t want, std::string* error) {
    int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                    : shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      *error = Errno("shm_open " + name);
      return false;
    }
    if (create) {
      // Reserve the pages now: a full /dev/shm is an error here, not a
      // SIGBUS in the middle of a step.
      int rc = posix_fallocate(fd, 0, static_cast<off_t>(want));
      if (rc != 0) {
        errno = rc;
        *error = Errno("reserving " + std::to_string(want >> 20) + " MiB in /dev/shm for " +
                       name);
        close(fd);
        return false;
      }
    } else {
      struct stat st;
      if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != want) {
        *error = name + " has the wrong size (is every rank on this host?)";
        close(fd);
        return false;
      }
    }
    base = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) {
      base = nullptr;
      *error = Errno("mmap " + name);
      return false;
    }
    bytes = want;
    header = static_cast<Header*>(base);
    slots = static_cast<char*>(base) + kHeaderBytes;
    return true;
  }
};

std::unique_ptr<ShmTransport> ShmTransport::Connect(const AgreeMin& agree_min, int world_rank,
                                                    const std::string& key, int local_rank,
                                                    int local_size, int cross_rank, int streams,
                                                    std::chrono::milliseconds timeout,
                                                    std::string* why_not) {
  std::unique_ptr<ShmTransport> shm(new ShmTransport());
  shm->rank_ = local_rank;
  shm->size_ = local_size;
  shm->timeout_ = timeout;
  const size_t n = static_cast<size_t>(shm->size_);
  shm->slot_bytes_ = std::max<size_t>(size_t{64} << 10, (kSetBytes / n) & ~size_t{4095});
  const size_t want = kHeaderBytes + 2 * n * shm->slot_bytes_;
  // Oversubscribed CPUs: a spinning rank takes the core a late rank needs.
  const unsigned cpus = std::thread::hardware_concurrency();
  shm->spin_ = cpus > n ? 20000 : 50;
  const uint64_t hash = Fnv1a(key.data(), key.size());
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));

  std::string error;
  bool ok = shm->size_ <= kMaxRanks;
  if (!ok) error = "more than " + std::to_string(kMaxRanks) + " ranks on the host";
  for (int s = 0; s < streams; ++s) {
    shm->segments_.emplace_back(new Segment());
    shm->segments_.back()->name = "/perseus-" + std::string(hex) + "-h" +
                                  std::to_string(cross_rank) + "-" + std::to_string(s);
  }
  // Whatever ends this function (a peer that fails or times out during the
  // control steps below throws), local rank 0 removes the names it created:
  // nothing is left in /dev/shm.
  struct UnlinkNames {
    std::vector<std::string> names;
    ~UnlinkNames() {
      for (const auto& name : names) shm_unlink(name.c_str());
    }
  } created;
  // Local rank 0 creates its host's segments; the others map them once it has.
  if (ok && shm->rank_ == 0) {
    for (auto& seg : shm->segments_) {
      shm_unlink(seg->name.c_str());  // a stale one from a crashed job of the same id
      if (!seg->Map(true, want, &error)) {
        ok = false;
        break;
      }
      created.names.push_back(seg->name);
      Header* h = seg->header;
      h->key = hash;
      h->size = static_cast<uint32_t>(n);
      h->slot_bytes = shm->slot_bytes_;
      std::atomic_thread_fence(std::memory_order_release);
      h->magic = kMagic;
    }
  }
  // `ok`: this rank has failed nothing so far; `all`: neither has any rank.
  bool all = agree_min(ok ? 1 : 0) == 1;
  if (all && shm->rank_ != 0) {
    for (auto& seg : shm->segments_) {
      if (!seg->Map(false, want, &error)) {
        ok = false;
        break;
      }
      std::atomic_thread_fence(std::memory_order_acquire);
      const Header* h = seg->header;
      if (h->magic != kMagic || h->key != hash || h->size != n ||
          h->slot_bytes != shm->slot_bytes_) {
        error = seg->name + " belongs to another job";
        ok = false;
        break;
      }
    }
  }
  if (all && ok) {
    for (auto& seg : shm->segments_) {
      seg->header->pid[shm->rank_] = static_cast<int32_t>(getpid());
      seg->header->world[shm->rank_] = world_rank;
    }
  }
  all = agree_min(all && ok ? 1 : 0) == 1;
  // Mapped everywhere (or given up): the names are no longer needed, and
  // nothing is left in /dev/shm however the job ends.
  if (shm->rank_ == 0) {
    for (auto& seg : shm->segments_) shm_unlink(seg->name.c_str());
  }
  if (!all) {
    *why_not = ok ? "" : error;
    return nullptr;
  }
  // A wait tells a dead rank from a late one by its pid: every rank must see
  // every other's process (not so across PID namespaces).
  bool visible = true;
  for (int r = 0; r < shm->size_ && visible; ++r) {
    visible = !ProcessGone(shm->segments_[0]->header->pid[r]);
  }
  if (agree_min(visible ? 1 : 0) != 1) {
    if (!visible) *why_not = "it cannot see the other ranks' processes (a separate PID namespace?)";
    return nullptr;
  }
  return shm;
}

ShmTransport::~ShmTransport() = default;

void ShmTransport::Abort() {
  for (auto& seg : segments_) {
    seg->header->aborted.store(rank_ + 1);  // a local rank; Barrier names it
    Futex(&seg->header->generation, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void ShmTransport::Barrier(Segment& s) {
  Header* h = s.header;
  const uint64_t mine = ++s.passed;
  h->entered[rank_].store(mine, std::memory_order_relaxed);
  const uint32_t gen = h->generation.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size_)) {
    h->arrived.store(0, std::memory_order_relaxed);
    h->generation.fetch_add(1, std::memory_order_seq_cst);
    if (h->waiters.load(std::memory_order_seq_cst) > 0) {
      Futex(&h->generation, FUTEX_WAKE, INT_MAX, nullptr);
    }
    return;
  }
  for (int i = 0; i < spin_; ++i) {
    if (h->generation.load(std::memory_order_acquire) != gen) return;
    PERSEUS_PAUSE();
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const timespec slice{0, 50 * 1000 * 1000};
  while (true) {
    h->waiters.fetch_add(1, std::memory_order_seq_cst);
    if (h->generation.load(std::memory_order_seq_cst) == gen &&
        h->aborted.load(std::memory_order_relaxed) == 0) {
      Futex(&h->generation, FUTEX_WAIT, gen, &slice);
    }
    h->waiters.fetch_sub(1, std::memory_order_relaxed);
    if (h->generation.load(std::memory_order_acquire) != gen) return;
    if (int32_t who = h->aborted.load()) {
      throw std::runtime_error("rank " + std::to_string(h->world[who - 1]) +
                               " failed or shut down during a shared-memory collective");
    }
    // Who has not arrived yet: gone, or late?
    std::vector<int> late;
    for (int r = 0; r < size_; ++r) {
      if (h->entered[r].load(std::memory_order_relaxed) >= mine) continue;
      if (ProcessGone(h->pid[r])) {
        throw std::runtime_error("rank " + std::to_string(h->world[r]) + " (pid " +
                                 std::to_string(h->pid[r]) +
                                 ") exited during a shared-memory collective");
      }
      late.push_back(h->world[r]);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream msg;
      msg << "a shared-memory collective timed out after " << timeout_.count() / 1000.0
          << " s (GLOO_TIMEOUT_SECONDS) waiting for rank";
      if (late.size() > 1) msg << "s";
      for (size_t i = 0; i < late.size(); ++i) msg << (i ? ", " : " ") << late[i];
      throw std::runtime_error(msg.str());
    }
  }
}

void ShmTransport::Allreduce(int stream, void* data, size_t count, DataType dtype, ReduceOp op) {
  Reduction(stream, data, count, dtype, HostReduceFn(dtype, op), true);
}

void ShmTransport::Reduce(int stream, void* data, size_t count, DataType dtype, ReduceOp op) {
  Reduction(stream, data, count, dtype, HostReduceFn(dtype, op), false);
}

void ShmTransport::Broadcast(int stream, void* data, size_t bytes) {
  if (bytes == 0 || size_ == 1) return;
  Segment& s = *segments_.at(static_cast<size_t>(stream));
  // A whole set of slots per chunk: the leader writes, the others read after
  // the barrier. The chunk after uses the other set, and the one after that
  // only starts once everyone has passed the next barrier, i.e. has read.
  const size_t capacity = static_cast<size_t>(size_) * slot_bytes_;
  char* base = static_cast<char*>(data);
  for (size_t done = 0; done < bytes;) {
    const size_t m = std::min(capacity, bytes - done);
    char* set = s.slots + static_cast<size_t>(s.set) * capacity;
    s.set ^= 1;
    if (rank_ == 0) std::memcpy(set, base + done, m);
    Barrier(s);
    if (rank_ != 0) std::memcpy(base + done, set, m);
    done += m;
  }
}

void ShmTransport::ReduceScatter(int stream, void* data, const std::vector<size_t>& counts,
                                 DataType dtype, ReduceOp op) {
  if (size_ == 1) return;
  if (counts.size() != static_cast<size_t>(size_)) {
    throw std::invalid_argument("shared-memory reduce-scatter: " +
                                std::to_string(counts.size()) + " blocks for " +
                                std::to_string(size_) + " ranks");
  }
  Segment& s = *segments_.at(static_cast<size_t>(stream));
  const ReduceFn fn = HostReduceFn(dtype, op);
  const size_t esize = DataTypeSize(dtype);
  const size_t n = static_cast<size_t>(size_);
  const size_t me = static_cast<size_t>(rank_);
  // A chunk takes the same span of every block: `per` elements of each
  // (whole cache lines), side by side in a rank's slot.
  size_t per = slot_bytes_ / esize / n;
  if (per > 16) per -= per % 16;
  std::vector<size_t> start(n);
  size_t most = 0;
  for (size_t r = 0, at = 0; r < n; at += counts[r], ++r) {
    start[r] = at;
    most = std::max(most, counts[r]);
  }
  char* base = static_cast<char*>(data);
  auto take = [&](size_t r, size_t from) {
    return std::min(counts[r], from + per) - std::min(counts[r], from);
  };
  for (size_t from = 0; from < most; from += per) {
    char* set = s.slots + static_cast<size_t>(s.set) * n * slot_bytes_;
    s.set ^= 1;
    auto piece = [&](size_t slot, size_t block) {
      return set + slot * slot_bytes_ + block * per * esize;
    };
    for (size_t r = 0; r < n; ++r) {
      std::memcpy(piece(me, r), base + (start[r] + from) * esize, take(r, from) * esize);
    }
    Barrier(s);
    const size_t m = take(me, from);
    if (m == 0) continue;
    // In rank order, as Reduction sums.
    char* out = base + (start[me] + from) * esize;
    fn(out, piece(0, me), piece(1, me), m);
    for (size_t r = 2; r < n; ++r) fn(out, out, piece(r, me), m);
  }
}

bool ShmTransport::Allgatherv(int stream, const void* in, void* out,
                              const std::vector<size_t>& bytes_per_rank) {
  const size_t n = static_cast<size_t>(size_);
  if (bytes_per_rank.size() != n) {
    throw std::invalid_argument("shared-memory allgather: " +
                                std::to_string(bytes_per_rank.size()) + " parts for " +
                                std::to_string(size_) + " ranks");
  }
  const size_t me = static_cast<size_t>(rank_);
  std::vector<size_t> start(n);
  size_t most = 0;
  for (size_t r = 0, at = 0; r < n; at += bytes_per_rank[r], ++r) {
    start[r] = at;
    most = std::max(most, bytes_per_rank[r]);
  }
  const char* mine = static_cast<const char*>(in);
  char* base = static_cast<char*>(out);
  if (bytes_per_rank[me] && base + start[me] != mine) {
    std::memmove(base + start[me], mine, bytes_per_rank[me]);
  }
  if (size_ == 1) return true;
  Segment& s = *segments_.at(static_cast<size_t>(stream));
  auto take = [&](size_t r, size_t from) {
    return std::min(bytes_per_rank[r], from + slot_bytes_) - std::min(bytes_per_rank[r], from);
  };
  for (size_t from = 0; from < most; from += slot_bytes_) {
    char* set = s.slots + static_cast<size_t>(s.set) * n * slot_bytes_;
    s.set ^= 1;
    std::memcpy(set + me * slot_bytes_, base + start[me] + from, take(me, from));
    Barrier(s);
    for (size_t r = 0; r < n; ++r) {
      if (r != me) std::memcpy(base + start[r] + from, set + r * slot_bytes_, take(r, from));
    }
  }
  return true;
}

void ShmTransport::Reduction(int stream, void* data, size_t count, DataType dtype, ReduceFn fn,
                             bool all) {
  if (count == 0 || size_ == 1) return;
  Segment& s = *segments_.at(static_cast<size_t>(stream));
  const size_t esize = DataTypeSize(dtype);
  const size_t slot_elems = slot_bytes_ / esize;
  const size_t n = static_cast<size_t>(size_);
  char* base = static_cast<char*>(data);
  for (size_t done = 0; done < count;) {
    const size_t m = std::min(slot_elems, count - done);
    char* set = s.slots + static_cast<size_t>(s.set) * n * slot_bytes_;
    s.set ^= 1;
    auto slot = [&](size_t r) { return set + r * slot_bytes_; };
    char* chunk = base + done * esize;
    std::memcpy(slot(rank_), chunk, m * esize);
    Barrier(s);
    // Portions of whole cache lines (16 elements of 4 bytes), one per rank.
    const size_t per = (m + n - 1) / n;
    const size_t step = ((per + 15) / 16) * 16;
    auto lo = [&](size_t r) { return std::min(m, r * step); };
    auto hi = [&](size_t r) { return std::min(m, (r + 1) * step); };
    const size_t a = lo(rank_), b = hi(rank_);
    if (b > a) {
      char* out = chunk + a * esize;
      fn(out, slot(0) + a * esize, slot(1) + a * esize, b - a);
      for (size_t r = 2; r < n; ++r) fn(out, out, slot(r) + a * esize, b - a);
      std::memcpy(slot(rank_) + a * esize, out, (b - a) * esize);
    }
    Barrier(s);
    for (size_t r = 0; r < n && (all || rank_ == 0); ++r) {
      if (r == static_cast<size_t>(rank_) || hi(r) <= lo(r)) continue;
      std::memcpy(chunk + lo(r) * esize, slot(r) + lo(r) * esize, (hi(r) - lo(r)) * esize);
    }
    done += m;
  }
}

}  // namespace perseus
