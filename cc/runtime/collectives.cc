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
// host's memory, the shared-memory allreduce is cheaper than either. A large
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
  void* out = q.allocate(shape);
  if (out == nullptr && counts[me] > 0) throw std::runtime_error("could not allocate the output");
  const size_t most = *std::max_element(counts.begin(), counts.end());
  const size_t chunk = std::max<size_t>(1, kReducescatterChunkBytes / (size * esize));
  const char* in = static_cast<const char*>(q.input);
  char* mine = static_cast<char*>(out);
  std::vector<char>& buf = streams_[stream]->scratch.fusion;
  const ReduceOp op = m.reduce_op;
  TimelineSpan span(timeline_, 1 + stream,
                    c_.topology.one_host_shm ? "shm allreduce" : "gloo reduce-scatter",
                    "communication");
  for (size_t from = 0; from < most; from += chunk) {
    std::vector<size_t> part(size);
    size_t total = 0, before_me = 0;
    for (int i = 0; i < size; ++i) {
      part[i] = std::min(counts[i], from + chunk) - std::min(counts[i], from);
      if (i < me) before_me += part[i];
      total += part[i];
    }
    if (buf.size() < total * esize) buf.resize(total * esize);
    size_t o = 0;
    for (int i = 0; i < size; ++i) {
      if (part[i]) std::memcpy(buf.data() + o * esize, in + (starts[i] + from) * esize,
                               part[i] * esize);
      o += part[i];
    }
    ScaleBuffer(buf.data(), dtype, total, m.prescale);
    if (c_.topology.one_host_shm) {
      c_.groups.host->Allreduce(stream, buf.data(), total, dtype, op);
    } else {
      c_.world->ReduceScatter(stream, buf.data(), part, dtype, op);
    }
    if (part[me]) std::memcpy(mine + from * esize, buf.data() + before_me * esize, part[me] * esize);
  }
  const double post = m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / size : 1.0);
  ScaleBuffer(out, dtype, counts[me], post);
}

}  // namespace perseus
