// The alpha-beta(-gamma) model that chooses, per bucket size, between the
// ring and recursive doubling for a flat allreduce across hosts
// (AllreduceTopology::doubling_bytes, allreduce_algorithms.h).
//
//   ring      2(N-1) hops in sequence, each rank sending 2(N-1)/N of the
//             bytes and reducing (N-1)/N of them;
//   doubling  L exchanges of the whole buffer (L = log2 p, plus 2 for the
//             fold when N is not a power of two p), each reduced.
//
// alpha: one hop's latency (seconds); beta: a link's bytes a second; gamma:
// seconds to reduce one byte on this host. The runtime measures them at
// init over the world's transport (or takes alpha and beta from
// PERSEUS_LINK_LATENCY_US and PERSEUS_LINK_BANDWIDTH_MBYTES) and agrees on
// one set on every rank, so every rank draws the same line.
#pragma once

#include <cstddef>
#include <cstdint>

namespace perseus {

class Transport;

struct LinkCost {
  double alpha = 0;  // seconds a hop
  double beta = 0;   // bytes a second
  double gamma = 0;  // seconds to reduce a byte
};

// The model's seconds for an allreduce of `bytes` among n ranks.
double RingSeconds(int n, double bytes, const LinkCost& cost);
double DoublingSeconds(int n, double bytes, const LinkCost& cost);

// The largest bucket (bytes) the model says doubling runs faster than the
// ring, at most kMaxDoublingBytes; 0 when never (n < 2). The cap is what
// the model leaves out: doubling receives a whole buffer before reducing
// it where Gloo's ring pipelines its blocks, and from 64 MiB at 2 hosts
// and 4 MiB at 4 the ring is faster (benchmarks/hosts_latency.py).
constexpr int64_t kMaxDoublingBytes = int64_t{16} << 20;
int64_t DoublingCrossover(int n, const LinkCost& cost);

// Collective over `world` on `channel` (every rank calls it at the same
// point, before the channel carries anything else): times recursive
// doubling of 4 bytes (alpha) and of 256 KiB (beta), where `given` has no
// alpha or beta (0: measure), and a float32 sum of 4 MiB, larger than a
// core's caches (gamma); returns
// the ranks' average, the same bits on every rank. Throws as the transport
// does.
LinkCost MeasureLinkCost(Transport& world, int channel, const LinkCost& given);

}  // namespace perseus
