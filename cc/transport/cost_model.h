// The alpha-beta(-gamma) model that chooses, per bucket size, between the
// ring and recursive doubling for a flat allreduce across hosts
// (AllreduceTopology::doubling_bytes, allreduce_algorithms.h), and between
// the flat allreduce and the two-level one when hosts have several ranks
// (TwoLevelCost below).
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

class GroupCollectives;
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

// The seconds of an allreduce among n ranks as ChooseAllreduce runs it
// flat: doubling from 4 bytes a rank up to `line`, the ring otherwise.
double FlatSeconds(int n, double bytes, const LinkCost& cost, int64_t line);

// Two link classes, in a job of several hosts with several ranks each:
// inside a host (shared memory or TCP) and across hosts. The two-level
// allreduce (allreduce_algorithms.h) reduces inside each host, allreduces
// among the H hosts' leaders (doubling up to cross_line, the ring past it)
// and broadcasts inside each host:
//
//   two-level(B) = host_seconds + B * host_per_byte + FlatSeconds(H, B, cross, cross_line)
struct TwoLevelCost {
  double host_seconds = 0;   // a host's reduce and broadcast of 4 bytes
  double host_per_byte = 0;  // and of each byte more
  LinkCost cross;            // a hop between two hosts' leaders
  int64_t cross_line = 0;    // the leaders' line between doubling and the ring
};

double TwoLevelSeconds(int hosts, double bytes, const TwoLevelCost& cost);

// Whether a bucket of `bytes` is faster in two levels than flat among the n
// ranks (`flat`, `line`: the flat group's costs and line). Two levels pay
// the host phases and save the flat path's waits on slow hops; the answer
// can change more than once with the size, so the runtime asks for every
// bucket (a few multiplications). False when nothing was measured.
bool TwoLevelFaster(int n, int hosts, double bytes, const LinkCost& flat, int64_t line,
                    const TwoLevelCost& cost);

// Collective over `world` (every rank calls it at the same point, before
// `channel` carries anything else on any of the three groups): times the
// host group's reduce and broadcast of 4 bytes and 256 KiB (every rank), and
// recursive doubling among the leaders as MeasureLinkCost does on the world
// (leaders only; `leaders` is null elsewhere) where `given` has no alpha or
// beta. Returns the host phases averaged over the ranks and the cross link
// over the leaders, the same bits on every rank; the leaders' line is
// `given_line` when it is not negative. Throws as the transports do.
TwoLevelCost MeasureTwoLevelCost(Transport& world, GroupCollectives& host,
                                 GroupCollectives* leaders, int hosts, int channel,
                                 const LinkCost& given, double gamma, int64_t given_line);

}  // namespace perseus
