// Allgather, alltoall and reducescatter on a stream.
#include "cc/runtime/executor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/core/reduce.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {
namespace {

std::vector<int64_t> Trailing(const std::vector<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin() + (shape.empty() ? 0 : 1), shape.end());
}

// The most scratch one chunk of a reduce-scatter takes (every rank's span).
constexpr size_t kReducescatterChunkBytes = size_t{64} << 20;

}  // namespace

void Executor::Allgather(int stream, const Response& r, Request& q) {
  const std::vector<int64_t>& dims = r.first_dims[0];
  std::vector<int64_t> trailing = Trailing(q.meta.shape);
  size_t row = static_cast<size_t>(NumElements(trailing)) * DataTypeSize(q.meta.dtype);
  int64_t rows = 0;
  std::vector<size_t> bytes;
  for (int64_t d : dims) {
    rows += d;
    bytes.push_back(static_cast<size_t>(d) * row);
  }
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && rows * row > 0) throw std::runtime_error("could not allocate the output");
  // Every rank on this host: through shared memory (copied in and out once).
  if (c_.topology.one_host_shm && c_.groups.host->Allgatherv(stream, q.input, out, bytes)) return;
  c_.world->Allgatherv(stream, q.input, out, bytes);
}

void Executor::Alltoall(int stream, const Response& r, Request& q) {
  const int me = c_.ranks.rank;
  std::vector<int64_t> trailing = Trailing(q.meta.shape);
  int64_t row = NumElements(trailing) * static_cast<int64_t>(DataTypeSize(q.meta.dtype));
  std::vector<int64_t> send(c_.ranks.size), recv(c_.ranks.size);
  int64_t rows = 0;
  q.received_splits.assign(c_.ranks.size, 0);
  for (int p = 0; p < c_.ranks.size; ++p) {
    send[p] = r.splits[me][p] * row;
    recv[p] = r.splits[p][me] * row;
    q.received_splits[p] = r.splits[p][me];
    rows += r.splits[p][me];
  }
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && rows * row > 0) throw std::runtime_error("could not allocate the output");
  bool any = false;
  for (const auto& sent_by : r.splits) {
    for (int64_t rows_sent : sent_by) any |= rows_sent > 0;
  }
  c_.world->Alltoallv(stream, q.input, send, out, recv, any && row > 0);
}

// Each rank gets the reduced rows of its own block. Over TCP a ring
// reduce-scatter moves each block once per step; when every rank shares this
// host's memory, the shared-memory reduce-scatter copies each rank's buffer
// in once and sums each block where it is wanted. A large
// tensor (a sharded optimizer's whole gradient) goes in chunks: each takes
// the same span of every rank's block, so the stream's scratch stays under
// kReducescatterChunkBytes instead of growing to the tensor.
void Executor::Reducescatter(int stream, const Response& r, Request& q) {
  const TensorMeta& m = r.metas[0];
  const DataType dtype = m.dtype;
  const size_t esize = DataTypeSize(dtype);
  const int size = c_.ranks.size;
  const int64_t me = c_.ranks.rank;
  // Rows are dealt out as evenly as possible, lower ranks taking the rest.
  const int64_t dim0 = q.meta.shape[0];
  const int64_t base = dim0 / size, extra = dim0 % size;
  const std::vector<int64_t> trailing = Trailing(q.meta.shape);
  const size_t row_elems = static_cast<size_t>(NumElements(trailing));
  std::vector<size_t> counts(size), starts(size);
  size_t at = 0;
  for (int i = 0; i < size; ++i) {
    counts[i] = (base + (i < extra ? 1 : 0)) * row_elems;
    starts[i] = at;
    at += counts[i];
  }
  const int64_t my_rows = base + (me < extra ? 1 : 0);
  std::vector<int64_t> shape{my_rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = nullptr;
  if (q.out_pieces.empty()) {
    out = q.allocate(shape);
    if (out == nullptr && counts[me] > 0) throw std::runtime_error("could not allocate the output");
  }
  for (const OutputPiece& p : q.out_pieces) {
    if (p.offset < 0 || static_cast<size_t>(p.offset + p.count) > counts[me]) {
      throw std::invalid_argument("reducescatter '" + m.name + "': an output of " +
                                  std::to_string(p.count) + " elements at " +
                                  std::to_string(p.offset) + " is outside this rank's " +
                                  std::to_string(counts[me]));
    }
  }
  const size_t most = *std::max_element(counts.begin(), counts.end());
  const size_t chunk = std::max<size_t>(1, kReducescatterChunkBytes / (size * esize));
  const char* in = static_cast<const char*>(q.input);
  char* mine = static_cast<char*>(out);
  std::vector<char>& buf = streams_[stream]->scratch.fusion;
  const ReduceOp op = m.reduce_op;
  // Float16 of (x * the gradient scale) on the wire, summed in float16 as an
  // allreduce's buckets are; mixed: only when the job spans hosts.
  const bool half = dtype == DataType::kFloat32 &&
                    (m.compression == kCompressFp16 ||
                     (m.compression == kCompressMixed && c_.topology.hosts > 1));
  const DataType wire = half ? DataType::kFloat16 : dtype;
  const size_t wsize = DataTypeSize(wire);
  const float scale = half ? static_cast<float>(c_.compression.gradient_scale) : 1.0f;
  const char* what = c_.topology.one_host_shm ? (half ? "shm reduce-scatter (fp16)" : "shm reduce-scatter")
                     : (half ? "gloo reduce-scatter (fp16)" : "gloo reduce-scatter");
  TimelineSpan span(timeline_, 1 + stream, what, "communication");
  // Elements [lo, lo + n) of the input, in the wire type, to `to`: from the
  // one input buffer, or from the pieces with zeros between them.
  const float pre_half = static_cast<float>(m.prescale) * scale;
  auto put = [&](const char* src, size_t n, char* to) {
    if (half) {
      FloatToHalfScaled(reinterpret_cast<const float*>(src), reinterpret_cast<uint16_t*>(to), n,
                        pre_half);
    } else if (n) {
      std::memcpy(to, src, n * esize);
    }
  };
  size_t piece = 0;  // spans are read in increasing order: the first piece still ahead
  auto read = [&](size_t lo, size_t n, char* to) {
    if (q.pieces.empty()) return put(in + lo * esize, n, to);
    const size_t end = lo + n;
    while (piece > 0 && static_cast<size_t>(q.pieces[piece - 1].offset +
                                            q.pieces[piece - 1].count) > lo) {
      --piece;
    }
    size_t at = lo;
    while (at < end) {
      while (piece < q.pieces.size() &&
             static_cast<size_t>(q.pieces[piece].offset + q.pieces[piece].count) <= at) {
        ++piece;
      }
      const size_t next = piece < q.pieces.size()
                              ? std::min(end, static_cast<size_t>(q.pieces[piece].offset))
                              : end;
      if (next > at) {  // no piece here: zeros
        std::memset(to + (at - lo) * wsize, 0, (next - at) * wsize);
        at = next;
        continue;
      }
      const InputPiece& p = q.pieces[piece];
      const size_t take = std::min(end, static_cast<size_t>(p.offset + p.count)) - at;
      put(static_cast<const char*>(p.data) + (at - p.offset) * esize, take,
          to + (at - lo) * wsize);
      at += take;
    }
  };
  // Elements [lo, lo + n) of this rank's block, from `src` (the wire type),
  // to the output or the output pieces. A piece may be its own input's
  // buffer: this chunk read that span already, and later chunks read later
  // spans only.
  auto get = [&](const char* src, size_t n, char* to) {
    if (half) {
      HalfToFloatScaled(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<float*>(to), n,
                        1.0f / scale);
    } else if (n) {
      std::memcpy(to, src, n * esize);
    }
  };
  auto write = [&](size_t lo, size_t n, const char* src) {
    if (q.out_pieces.empty()) return get(src, n, mine + lo * esize);
    for (const OutputPiece& p : q.out_pieces) {
      const size_t a = std::max(lo, static_cast<size_t>(p.offset));
      const size_t b = std::min(lo + n, static_cast<size_t>(p.offset + p.count));
      if (a < b) get(src + (a - lo) * wsize, b - a, static_cast<char*>(p.data) + (a - p.offset) * esize);
    }
  };
  for (size_t from = 0; from < most; from += chunk) {
    std::vector<size_t> part(size);
    size_t total = 0, before_me = 0;
    for (int i = 0; i < size; ++i) {
      part[i] = std::min(counts[i], from + chunk) - std::min(counts[i], from);
      if (i < me) before_me += part[i];
      total += part[i];
    }
    if (buf.size() < total * wsize) buf.resize(total * wsize);
    size_t o = 0;
    for (int i = 0; i < size; ++i) {
      read(starts[i] + from, part[i], buf.data() + o * wsize);
      o += part[i];
    }
    if (!half) ScaleBuffer(buf.data(), dtype, total, m.prescale);
    const ReduceOp wire_op = half && op == ReduceOp::kAverage ? ReduceOp::kSum : op;
    if (c_.topology.one_host_shm) {
      c_.groups.host->ReduceScatter(stream, buf.data(), part, wire, wire_op);
    } else {
      c_.world->ReduceScatter(stream, buf.data(), part, wire, wire_op);
    }
    write(from, part[me], buf.data() + before_me * wsize);
  }
  const double post = m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / size : 1.0);
  if (q.out_pieces.empty()) ScaleBuffer(out, dtype, counts[me], post);
  for (const OutputPiece& p : q.out_pieces) {
    ScaleBuffer(p.data, dtype, static_cast<size_t>(p.count), post);
  }
}

}  // namespace perseus
