// A fake libnccl.so.2 for the tests of cc/transport/nccl.h where there is no
// GPU: the same C symbols, on host memory, with behaviour scripted by the
// environment variable FAKE_NCCL_SCRIPT, read at every call:
//   (unset)          communicators become ready after a few polls; ranks of
//                    one unique id (threads of one process) meet in each
//                    collective, which sums float32 (or copies, for one rank)
//   init_hang        communicators stay in progress for ever
//   allreduce_hang   allreduces stay in progress for ever
//   allreduce_error  allreduces end with ncclRemoteError (a peer died)
// FAKE_NCCL_VERSION sets the version code (default 22304). fake_nccl_aborts()
// counts ncclCommAbort calls, fake_nccl_last_blocking() is the `blocking`
// field of the last config.
// Built by tests/test_cc_unit.py with g++ -shared; not part of any library.
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

enum { kSuccess = 0, kInvalidArgument = 4, kRemoteError = 6, kInProgress = 7 };

struct Id {
  char internal[128];
};

struct Config {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};

struct Meeting {
  int nranks = 0;
  int arrived = 0;
  int generation = 0;
  std::vector<const float*> send;
  std::vector<float*> recv;
  size_t count = 0;
};

struct Comm {
  std::string id;
  int rank = 0;
  int nranks = 1;
  int polls_left = 3;      // until the communicator is ready
  int pending_generation = -1;  // a collective waiting for the other ranks
  bool aborted = false;
};

std::mutex mu;
std::map<std::string, Meeting> meetings;
int aborts = 0;
int last_blocking = -99;

std::string Script() {
  const char* s = std::getenv("FAKE_NCCL_SCRIPT");
  return s ? s : "";
}

}  // namespace

extern "C" {

int fake_nccl_aborts() {
  std::lock_guard<std::mutex> lock(mu);
  return aborts;
}
int fake_nccl_last_blocking() {
  std::lock_guard<std::mutex> lock(mu);
  return last_blocking;
}

int ncclGetVersion(int* version) {
  const char* v = std::getenv("FAKE_NCCL_VERSION");
  *version = v ? std::atoi(v) : 22304;
  return kSuccess;
}

const char* ncclGetErrorString(int r) {
  switch (r) {
    case kSuccess: return "no error";
    case kRemoteError: return "remote process exited or there was a network error";
    case kInProgress: return "NCCL operation in progress";
    default: return "fake NCCL error";
  }
}

int ncclGetUniqueId(Id* id) {
  std::random_device rd;
  for (size_t i = 0; i < sizeof(id->internal); ++i) id->internal[i] = static_cast<char>(rd());
  return kSuccess;
}

int ncclCommInitRankConfig(void** comm, int nranks, Id id, int rank, Config* config) {
  if (config == nullptr || config->magic != 0xcafebeef) return kInvalidArgument;
  Comm* c = new Comm();
  c->id.assign(id.internal, sizeof(id.internal));
  c->rank = rank;
  c->nranks = nranks;
  {
    std::lock_guard<std::mutex> lock(mu);
    last_blocking = config->blocking;
    meetings[c->id].nranks = nranks;
  }
  *comm = c;
  return kInProgress;
}

int ncclCommGetAsyncError(void* comm, int* state) {
  Comm* c = static_cast<Comm*>(comm);
  const std::string script = Script();
  std::lock_guard<std::mutex> lock(mu);
  if (c->aborted) {
    *state = kRemoteError;
    return kSuccess;
  }
  if (c->polls_left > 0) {
    if (script != "init_hang") --c->polls_left;
    *state = kInProgress;
    return kSuccess;
  }
  if (c->pending_generation >= 0) {
    if (script == "allreduce_error") {
      *state = kRemoteError;
      return kSuccess;
    }
    Meeting& m = meetings[c->id];
    *state = m.generation > c->pending_generation ? kSuccess : kInProgress;
    if (*state == kSuccess) c->pending_generation = -1;
    return kSuccess;
  }
  *state = kSuccess;
  return kSuccess;
}

int ncclCommAbort(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  std::lock_guard<std::mutex> lock(mu);
  ++aborts;
  c->aborted = true;
  return kSuccess;
}

int ncclCommDestroy(void* comm) {
  delete static_cast<Comm*>(comm);
  return kSuccess;
}

int ncclCommCount(void* comm, int* n) {
  *n = static_cast<Comm*>(comm)->nranks;
  return kSuccess;
}

int ncclCommUserRank(void* comm, int* rank) {
  *rank = static_cast<Comm*>(comm)->rank;
  return kSuccess;
}

}  // extern "C"

namespace {

// A float32 sum over the ranks of `comm`'s id, into every rank's recv
// (root < 0) or root's alone; the last rank to arrive computes it.
int Meet(const void* send, void* recv, size_t count, int dtype, int op, int root, void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  const std::string script = Script();
  std::lock_guard<std::mutex> lock(mu);
  if (dtype != 7 || op != 0) return kInvalidArgument;  // float32 sums only
  Meeting& m = meetings[c->id];
  c->pending_generation = m.generation;
  if (script == "allreduce_hang" || script == "allreduce_error") return kInProgress;
  if (m.arrived == 0) {
    m.send.assign(m.nranks, nullptr);
    m.recv.assign(m.nranks, nullptr);
    m.count = count;
  }
  m.send[c->rank] = static_cast<const float*>(send);
  m.recv[c->rank] = static_cast<float*>(recv);
  if (++m.arrived == m.nranks) {
    std::vector<float> sum(count, 0.0f);
    for (int r = 0; r < m.nranks; ++r) {
      for (size_t i = 0; i < count; ++i) sum[i] += m.send[r][i];
    }
    for (int r = 0; r < m.nranks; ++r) {
      if (root < 0 || r == root) std::memcpy(m.recv[r], sum.data(), count * sizeof(float));
    }
    m.arrived = 0;
    ++m.generation;
  }
  return kInProgress;
}

}  // namespace

extern "C" {

int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, void* comm,
                  void*) {
  return Meet(send, recv, count, dtype, op, -1, comm);
}

int ncclReduce(const void* send, void* recv, size_t count, int dtype, int op, int root, void* comm,
               void*) {
  return Meet(send, recv, count, dtype, op, root, comm);
}

int ncclBroadcast(const void* send, void* recv, size_t bytes, int, int root, void* comm, void*) {
  Comm* c = static_cast<Comm*>(comm);
  if (c->nranks == 1 && root == 0 && send != recv) std::memcpy(recv, send, bytes);
  return c->nranks == 1 ? kSuccess : kInvalidArgument;
}

int ncclGroupStart() { return kSuccess; }
int ncclGroupEnd() { return kSuccess; }

}  // extern "C"
