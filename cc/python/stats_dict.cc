#include "cc/python/stats_dict.h"

#include <pybind11/stl.h>

namespace perseus {

pybind11::dict StatsToDict(const Stats& st) {
  pybind11::dict d;
  d["cycles"] = st.cycles;
  d["control_bytes_sent"] = st.control_bytes_sent;
  d["startup_store_seconds"] = st.startup_store_seconds;
  d["startup_connect_seconds"] = st.startup_connect_seconds;
  d["allreduce_doubling_bytes"] = st.allreduce_doubling_bytes;
  d["link_latency_us"] = st.link_latency_us;
  d["link_bandwidth_mbytes"] = st.link_bandwidth_mbytes;
  d["reduce_mbytes"] = st.reduce_mbytes;
  d["host_phase_us"] = st.host_phase_us;
  d["host_phase_mbytes"] = st.host_phase_mbytes;
  d["cross_latency_us"] = st.cross_latency_us;
  d["cross_bandwidth_mbytes"] = st.cross_bandwidth_mbytes;
  d["leaders_doubling_bytes"] = st.leaders_doubling_bytes;
  d["requests"] = st.requests;
  d["responses"] = st.responses;
  d["fused_responses"] = st.fused_responses;
  d["device_buffer_bytes"] = st.device_buffer_bytes;
  d["staging_buffer_bytes"] = st.staging_buffer_bytes;
  d["plans"] = st.plans;
  d["perf_reports"] = st.perf_reports;
  d["slow_ranks"] = st.slow_ranks;
  d["plan_exits"] = st.plan_exits;
  d["offline_steps"] = st.offline_steps;
  d["plan_checks"] = st.plan_checks;
  d["plan_timeouts"] = st.plan_timeouts;
  d["hierarchical"] = st.hierarchical;
  d["shm"] = st.shm;
  d["round"] = st.round;
  auto stream_dict = [](const StreamStats& s) {
    pybind11::dict sd;
    sd["responses"] = s.responses;
    sd["tensors"] = s.tensors;
    sd["bytes"] = s.bytes;
    sd["busy_seconds"] = s.busy_seconds;
    sd["wait_seconds"] = s.wait_seconds;
    return sd;
  };
  // The last stream only carries online work while a plan runs offline.
  pybind11::list streams;
  for (size_t i = 0; i + 1 < st.streams.size(); ++i) streams.append(stream_dict(st.streams[i]));
  d["streams"] = streams;
  if (!st.streams.empty()) d["online_stream"] = stream_dict(st.streams.back());
  return d;
}

}  // namespace perseus
