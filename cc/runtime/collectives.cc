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
// host's memory, the shared-memory allreduce is cheaper than either.
void Executor::Reducescatter(int stream, const Response& r, Request& q) {
  const TensorMeta& m = r.metas[0];
  const DataType dtype = m.dtype;
  const size_t esize = DataTypeSize(dtype);
  size_t n = static_cast<size_t>(NumElements(q.meta.shape));
  std::vector<char>& buf = streams_[stream]->scratch.fusion;
  if (buf.size() < n * esize) buf.resize(n * esize);
  if (n) std::memcpy(buf.data(), q.input, n * esize);
  ScaleBuffer(buf.data(), dtype, n, m.prescale);
  // Rows are dealt out as evenly as possible, lower ranks taking the rest.
  const int64_t dim0 = q.meta.shape[0];
  const int64_t base = dim0 / c_.ranks.size, extra = dim0 % c_.ranks.size;
  const std::vector<int64_t> trailing = Trailing(q.meta.shape);
  const size_t row_elems = static_cast<size_t>(NumElements(trailing));
  std::vector<size_t> counts(c_.ranks.size);
  for (int i = 0; i < c_.ranks.size; ++i) counts[i] = (base + (i < extra ? 1 : 0)) * row_elems;
  const ReduceOp op = m.reduce_op;
  if (c_.topology.one_host_shm) {
    TimelineSpan span(timeline_, 1 + stream, "shm allreduce", "communication");
    c_.groups.host->Allreduce(stream, buf.data(), n, dtype, op);
  } else {
    TimelineSpan span(timeline_, 1 + stream, "gloo reduce-scatter", "communication");
    c_.world->ReduceScatter(stream, buf.data(), counts, dtype, op);
  }
  const int64_t me = c_.ranks.rank;
  const int64_t my_rows = base + (me < extra ? 1 : 0);
  const int64_t first_row = me * base + std::min(me, extra);
  const size_t row = row_elems * esize;
  std::vector<int64_t> shape{my_rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && my_rows * row > 0) throw std::runtime_error("could not allocate the output");
  if (my_rows) std::memcpy(out, buf.data() + first_row * row, my_rows * row);
  const double post =
      m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / c_.ranks.size : 1.0);
  ScaleBuffer(out, dtype, static_cast<size_t>(my_rows * row_elems), post);
}

}  // namespace perseus
