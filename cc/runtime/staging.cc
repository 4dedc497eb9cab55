// Staging (staging.h): requests copied between host and device memory around
// a collective that runs where they are not.
#include "cc/runtime/staging.h"

#include <stdexcept>

namespace perseus {

bool RunLifted(DataPlane& plane, int stream, Requests& requests, const StagedBody& body) {
  auto bytes_of = [](const Request& q) {
    return static_cast<size_t>(NumElements(q.meta.shape)) * DataTypeSize(q.meta.dtype);
  };
  size_t total = 0;
  for (const auto& q : requests) {
    if (q->where.kind == MemoryKind::kHost) total += bytes_of(*q);
  }
  char* lift = static_cast<char*>(plane.Buffer(stream, PlaneBuffer::kLift, total));
  Requests lifted;
  std::vector<std::pair<Request*, char*>> back;  // host request, its bytes on the device
  size_t offset = 0;
  for (auto& q : requests) {
    if (q->where.kind != MemoryKind::kHost) {
      lifted.push_back(q);
      continue;
    }
    char* at = lift + offset;
    offset += bytes_of(*q);
    if (q->input != nullptr && bytes_of(*q)) plane.FromHost(stream, at, q->input, bytes_of(*q));
    auto d = std::make_shared<Request>();
    d->meta = q->meta;
    d->input = at;
    d->output = q->output != nullptr ? at : nullptr;
    d->where.kind = plane.kind();
    d->where.device = plane.device();
    lifted.push_back(std::move(d));
    if (q->output != nullptr) back.emplace_back(q.get(), at);
  }
  if (!body(lifted)) return false;
  for (const auto& b : back) {
    if (bytes_of(*b.first)) plane.ToHost(stream, b.first->output, b.second, bytes_of(*b.first));
  }
  return true;
}

bool RunStaged(DataPlane& plane, int stream, Requests& requests, const StagedBody& body) {
  // Inputs and the outputs whose size is known go through one block of the
  // plane's staging memory (pinned on a GPU, so the copies are asynchronous
  // and at full speed); outputs the collective sizes itself (allgather,
  // alltoall) through host vectors, filled once their size is known.
  struct Stage {
    std::vector<char> out;
    std::vector<int64_t> shape;
    bool allocated = false;
  };
  auto bytes_of = [](const Request& q) {
    return static_cast<size_t>(NumElements(q.meta.shape)) * DataTypeSize(q.meta.dtype);
  };
  size_t total = 0;
  for (const auto& q : requests) {
    if (q->input) total += bytes_of(*q);
    if (q->output && q->output != q->input) total += bytes_of(*q);
  }
  char* pinned = static_cast<char*>(plane.Buffer(stream, PlaneBuffer::kStaging, total));
  size_t offset = 0;
  std::vector<Stage> stages(requests.size());
  Requests host;
  for (size_t i = 0; i < requests.size(); ++i) {
    Request& q = *requests[i];
    Stage& st = stages[i];
    auto h = std::make_shared<Request>();
    h->meta = q.meta;
    const size_t esize = DataTypeSize(q.meta.dtype);
    const size_t bytes = bytes_of(q);
    char* in = nullptr;
    if (q.input) {
      in = pinned + offset;
      offset += bytes;
      plane.ToHost(stream, in, q.input, bytes);
      h->input = in;
    }
    if (q.output) {
      if (q.output == q.input) {
        h->output = in;
      } else {
        h->output = pinned + offset;
        offset += bytes;
      }
    }
    if (q.allocate) {
      Stage* s = &st;
      h->allocate = [s, esize](const std::vector<int64_t>& shape) -> void* {
        s->shape = shape;
        s->allocated = true;
        s->out.resize(static_cast<size_t>(NumElements(shape)) * esize);
        return s->out.data();
      };
    }
    host.push_back(std::move(h));
  }
  if (!body(host)) return false;
  for (size_t i = 0; i < requests.size(); ++i) {
    Request& q = *requests[i];
    Request& h = *host[i];
    Stage& st = stages[i];
    q.received_splits = h.received_splits;
    q.result = h.result;
    if (st.allocated) {
      void* out = q.allocate(st.shape);
      if (out == nullptr && !st.out.empty()) {
        throw std::runtime_error("could not allocate the output");
      }
      // The caller's allocation may hand back a new `ready` (TF: an event on
      // its stream after the allocation): written only after it.
      plane.WaitReady(stream, q.where);
      plane.FromHost(stream, out, st.out.data(), st.out.size());
    } else if (q.output) {
      plane.FromHost(stream, q.output, h.output, bytes_of(q));
    }
  }
  return true;
}

}  // namespace perseus
