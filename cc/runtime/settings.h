// Generated from perseus_tf/config/spec.py by tools/gen_settings.py: do not edit.
// The runtime's settings, one struct per part that reads them; names,
// defaults and meanings are the table's (that module's docstring).
#pragma once

#include <cstdint>
#include <string>

namespace perseus {

struct TransportSettings {
  // PERSEUS_GLOO_NETWORK_INTERFACE: The interface Gloo binds to. `perseusrun
  // --network-interface` sets it on every host.
  std::string gloo_iface = "";
  // PERSEUS_ALLREDUCE_STREAMS: The number of communication streams: Gloo
  // contexts, each with its own thread and TCP connections, that reduce buckets
  // in parallel. Unset: 4 (auto).
  int streams = 4;
  // PERSEUS_SHM_ALLREDUCE: 1: the ranks of a host reduce through shared memory
  // (`/dev/shm`); 0: Gloo over TCP.
  bool shm_allreduce = true;
  // PERSEUS_ALLREDUCE_MODE: 0: one flat ring over all ranks. 1: hierarchical:
  // reduce within each host, allreduce among hosts, broadcast within each host.
  // Unset: a cost model picks one for each bucket
  // ([Communication](communication.md#two-levels-or-flat)). Unset: -1 (auto).
  int allreduce_mode = -1;
  // PERSEUS_ALLREDUCE_DOUBLING_BYTES: Buckets of at most this many bytes that
  // cross hosts over one flat group reduce by recursive doubling (log2 N
  // exchanges) instead of the ring (2(N-1) steps). 0: always the ring. Unset: a
  // cost model draws the line at init ([Communication](communication.md#the-
  // cost-model)). Unset: -1 (auto).
  int64_t allreduce_doubling_bytes = -1;
  // PERSEUS_LINK_LATENCY_US: The cost model's latency of one hop between hosts,
  // in microseconds, instead of the one measured at init. Unset: 0 (measured).
  double link_latency_us = 0.0;
  // PERSEUS_LINK_BANDWIDTH_MBYTES: The cost model's bandwidth of a link between
  // hosts, in MB (10^6 bytes) a second, instead of the one measured at init.
  // Unset: 0 (measured).
  double link_bandwidth_mbytes = 0.0;
  // GLOO_TIMEOUT_SECONDS: How long a rank waits on its peers, or on a store that
  // stopped answering, before it reports the rank or store as gone.
  double timeout_seconds = 60.0;
};

struct NegotiationSettings {
  // PERSEUS_FUSION_THRESHOLD: The largest bucket, in bytes, that allreduces
  // ready in the same cycle are fused into. 0 turns fusion off.
  int64_t fusion_threshold_bytes = 67108864;
  // PERSEUS_CYCLE_TIME_MS: Negotiation cycles start at least this many
  // milliseconds apart (further apart after a quiet spell:
  // [Communication](communication.md#fusion)).
  double cycle_time_ms = 1.0;
  // PERSEUS_ALLREDUCE_FUSION: Buckets of an offline plan: N splits a step's
  // gradient bytes into buckets of about 1/N each; 0 puts one tensor in each
  // bucket. Unset: -1 (auto).
  int fusion = -1;
  // PERSEUS_STALL_CHECK_TIME_SECONDS: Stall inspector: rank 0 prints a
  // collective that some ranks submitted and others did not once it has waited
  // this long, then again every interval. 0 turns it off.
  double stall_check_seconds = 60.0;
  // PERSEUS_STALL_TIMEOUT_SECONDS: Such a collective then fails on every rank,
  // naming who submitted it and who did not. 0 waits forever.
  double stall_timeout_seconds = 1800.0;
  // PERSEUS_OFFLINE_NEG_CHECK_N_STEPS: Compares the ranks' copies of the offline
  // plan when it starts and every N plan steps. Different plans fail the job,
  // naming the tensor.
  int offline_neg_check_n_steps = 0;
};

struct CompressionSettings {
  // PERSEUS_ALLREDUCE_GRADIENT_SCALE: Gradients are multiplied by it before they
  // become float16, and divided by it after the sum.
  double gradient_scale = 10.0;
  // PERSEUS_TOPK_RATIO: The fraction of a tensor's elements that top-k sends.
  double topk_ratio = 0.01;
  // PERSEUS_TOPK_THRESHOLD: The smallest tensor, in bytes, that top-k applies
  // to. Smaller ones follow `PERSEUS_ALLREDUCE_DTYPE`.
  int64_t topk_threshold = 1048576;
  // PERSEUS_TOPK_FP16: 1: top-k values travel as float16, times the gradient
  // scale.
  bool topk_fp16 = false;
  // PERSEUS_DOWNSAMPLE_N_ELEMENTS: N above 1: each step a tensor sends every
  // N-th element; the rest waits in a residual for later steps.
  int downsample_n_elements = 1;
  // PERSEUS_GRADIENT_MOMENTUM: Downsampling: the residual is multiplied by this
  // every step.
  double gradient_momentum = 1.0;
  // PERSEUS_ALLREDUCE_NANCHECK: 1: a reduction whose input holds NaN or Inf
  // fails on every rank, naming the tensor and the ranks.
  bool nancheck = false;
};

struct HealthSettings {
  // PERSEUS_PERF_CHECK_N_STEPS: Every N offline-plan steps, names the ranks
  // whose time outside communication is over 1.5 times the median.
  int perf_check_n_steps = 0;
};

// Every field above as X(Part, name), in the table's order.
#define PERSEUS_NATIVE_SETTINGS(X) \
  X(TransportSettings, gloo_iface) \
  X(NegotiationSettings, fusion_threshold_bytes) \
  X(NegotiationSettings, cycle_time_ms) \
  X(NegotiationSettings, fusion) \
  X(CompressionSettings, gradient_scale) \
  X(CompressionSettings, topk_ratio) \
  X(CompressionSettings, topk_threshold) \
  X(CompressionSettings, topk_fp16) \
  X(CompressionSettings, downsample_n_elements) \
  X(CompressionSettings, gradient_momentum) \
  X(TransportSettings, streams) \
  X(TransportSettings, shm_allreduce) \
  X(TransportSettings, allreduce_mode) \
  X(TransportSettings, allreduce_doubling_bytes) \
  X(TransportSettings, link_latency_us) \
  X(TransportSettings, link_bandwidth_mbytes) \
  X(TransportSettings, timeout_seconds) \
  X(NegotiationSettings, stall_check_seconds) \
  X(NegotiationSettings, stall_timeout_seconds) \
  X(HealthSettings, perf_check_n_steps) \
  X(CompressionSettings, nancheck) \
  X(NegotiationSettings, offline_neg_check_n_steps)

}  // namespace perseus
