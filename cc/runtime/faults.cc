#include "cc/runtime/faults.h"

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

namespace perseus {

std::unique_ptr<FaultInjector> FaultInjector::FromEnv(int world_rank, int process_set_id) {
  if (process_set_id != 0) return nullptr;
  std::unique_ptr<FaultInjector> faults(new FaultInjector());
  bool any = false;
  if (const char* die = std::getenv("PERSEUS_TEST_EXIT_BEFORE_SHM")) {
    faults->exit_before_shm_ = std::atoi(die) == world_rank;
    any = any || faults->exit_before_shm_;
  }
  if (const char* swap = std::getenv("PERSEUS_TEST_PLAN_SWAP")) {
    int rank = -1;
    long long step = 0;
    if (std::sscanf(swap, "%d:%lld", &rank, &step) == 2 && rank == world_rank) {
      faults->swap_step_ = step;
      any = true;
    }
  }
  if (const char* delay = std::getenv("PERSEUS_TEST_ERROR_DISPATCH_DELAY_MS")) {
    faults->error_dispatch_delay_ms_ = std::max(0, std::atoi(delay));
    any = any || faults->error_dispatch_delay_ms_ > 0;
  }
  if (const char* pause = std::getenv("PERSEUS_TEST_ENQUEUE_PAUSE")) {
    faults->enqueue_pause_file_ = pause;
    any = any || *pause != '\0';
  }
  if (!any) faults.reset();
  return faults;
}

void FaultInjector::BeforeSharedMemory() const {
  if (exit_before_shm_) std::_Exit(7);
}

void FaultInjector::AfterErrorResponse() const {
  if (error_dispatch_delay_ms_ > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(error_dispatch_delay_ms_));
  }
}

void FaultInjector::BeforeQueuing(const std::function<bool()>& shut_down) const {
  if (enqueue_pause_file_.empty() || enqueue_paused_.exchange(true)) return;
  if (std::FILE* f = std::fopen(enqueue_pause_file_.c_str(), "w")) std::fclose(f);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!shut_down() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void FaultInjector::OnPlanStep(int64_t step, Plan* plan) const {
  if (step != swap_step_) return;
  // The first bucket with two same-shaped tensors trades them (this rank's
  // requests still fit its plan).
  for (Response& b : plan->buckets) {
    size_t i = 0, j = 1;
    while (j < b.names.size() &&
           !(b.metas[j].shape == b.metas[i].shape && b.metas[j].dtype == b.metas[i].dtype)) {
      ++j;
    }
    if (j < b.names.size()) {
      std::swap(b.names[i], b.names[j]);
      std::swap(b.metas[i], b.metas[j]);
      return;
    }
  }
}

}  // namespace perseus
