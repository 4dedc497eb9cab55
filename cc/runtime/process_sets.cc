// Process sets: the registry of runtimes by process-set id (the world is 0).
#include "cc/runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include <pthread.h>
#include <unistd.h>

#include "cc/core/reduce.h"
#include "cc/rendezvous/store_client.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {

// Process-set runtimes by id. Like the world's, they are never destroyed:
// their threads may still run while the process exits.
std::mutex registry_mu;
std::map<int, Runtime*>& Registry() {
  static auto* registry = new std::map<int, Runtime*>();
  return *registry;
}

namespace {
// Set in a child forked after init(): which rank it was forked from.
std::string forked_after_init;
}  // namespace

Runtime*& Runtime::WorldSlot() {
  static Runtime* runtime = new Runtime();
  return runtime;
}

// In the child of fork(): only the forking thread exists. The parent's
// runtimes, whose threads stayed behind, are left as they are (never
// touched again); the child gets a world runtime of its own, not
// initialized, and an empty registry. A lock some other thread held at the
// fork is held for ever here: the registry's is made anew.
void Runtime::InChildAfterFork() {
  Runtime* parent = WorldSlot();
  const std::string state = parent->state_name();
  if (state == "uninitialized" || state == "shutdown") return;
  forked_after_init = "Perseus is not initialized in this process: this process is a fork "
                      "(made after init()) of rank " +
                      std::to_string(parent->options().rank) + ", pid " +
                      std::to_string(static_cast<long>(::getppid())) +
                      ", and a fork does not share its parent's runtime. A forked process "
                      "must call init() itself (as a rank of a job of its own), or fork "
                      "before init() (or use multiprocessing's 'spawn' start method)";
  WorldSlot() = new Runtime();
  new (&registry_mu) std::mutex();
  new (&Registry()) std::map<int, Runtime*>();
}

Runtime& Runtime::Get() {
  static const bool watching_forks = ::pthread_atfork(nullptr, nullptr, InChildAfterFork) == 0;
  (void)watching_forks;
  return *WorldSlot();
}

std::string Runtime::ForkedAfterInit() { return forked_after_init; }

Runtime* Runtime::Find(int process_set_id) {
  if (process_set_id == 0) return &Get();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(process_set_id);
  return it == Registry().end() ? nullptr : it->second;
}

std::vector<int> Runtime::ProcessSetIds() {
  std::lock_guard<std::mutex> lock(registry_mu);
  std::vector<int> ids;
  // Stopped ones too: a set whose other members removed it first has seen
  // their shutdown in its last cycle and stopped, but is still registered
  // here until this rank removes it.
  for (const auto& kv : Registry()) ids.push_back(kv.first);
  return ids;
}

Status Runtime::AddProcessSet(int id, const std::vector<int>& world_ranks) {
  Runtime& world = Get();
  if (!world.initialized()) {
    return Status::Error(StatusCode::kFailedPrecondition,
                         "Perseus is not initialized: call init() before adding a process set");
  }
  if (id <= 0) {
    return Status::Error(StatusCode::kInvalidArgument, "process set ids start at 1");
  }
  InitOptions o = world.options();
  auto me = std::find(world_ranks.begin(), world_ranks.end(), o.rank);
  if (me == world_ranks.end()) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "rank " + std::to_string(o.rank) + " is not a member of process set " +
                             std::to_string(id));
  }
  o.rank = static_cast<int>(me - world_ranks.begin());
  o.size = static_cast<int>(world_ranks.size());
  o.process_set_id = id;
  o.global_ranks = world_ranks;
  Runtime* rt;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    if (Registry().count(id)) {
      return Status::Error(StatusCode::kInvalidArgument,
                           "process set " + std::to_string(id) + " already exists");
    }
    rt = new Runtime();
    Registry().emplace(id, rt);
  }
  return rt->Init(o);
}

Status Runtime::RemoveProcessSet(int id) {
  Runtime* rt = id == 0 ? nullptr : Find(id);
  if (rt == nullptr) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "process set " + std::to_string(id) + " does not exist on this rank");
  }
  rt->Shutdown();
  // Its threads are joined; the object itself is left allocated (a caller
  // might still hold the pointer), but the id no longer resolves.
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().erase(id);
  return Status::OK();
}

void Runtime::AbortAll(const std::string& why) {
  std::vector<Runtime*> sets;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    for (const auto& kv : Registry()) sets.push_back(kv.second);
    Registry().clear();  // their ids no longer resolve; the objects stay (see above)
  }
  for (Runtime* rt : sets) rt->Abort(why);
  Get().Abort(why);
}

}  // namespace perseus
