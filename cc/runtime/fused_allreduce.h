// The fused allreduce of one bucket: its tensors packed into the stream's
// fusion buffer (with a plan bucket's envelope after them, plan/envelope.h), reduced
// once, and unpacked into each output; tensors too large to be worth the
// copies are reduced where they are, after the packed rest.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "cc/core/timeline.h"
#include "cc/device/data_plane.h"
#include "cc/runtime/response.h"
#include "cc/runtime/request.h"

namespace perseus {

// A tensor of this many bytes or more in a fused host bucket is reduced in
// place rather than packed: copying it into the fusion buffer and back costs
// more than one more allreduce's start.
constexpr size_t kInPlaceBytes = size_t{4} << 20;

struct FusedBucket {
  DataPlane* plane = nullptr;
  int stream = 0;
  Timeline* timeline = nullptr;
  int rank = 0;
  int size = 1;
  // The executor's allreduce of a buffer of `plane` on `stream` (half_across:
  // the elements mixed compression sends as float16 between hosts).
  std::function<void(void* buf, size_t count, DataType dtype, ReduceOp op, size_t half_across)>
      reduce;
};

// The requests a bucket packs, and those it reduces in place (decided from
// the response's metas, so alike on every rank).
void SplitForFusion(const Response& r, const Requests& requests,
                    Requests* packed,
                    Requests* large);

// Packs `requests` (possibly none) with a plan bucket's extras, reduces them
// once and unpacks; false when the plan's vote says not to deliver.
bool RunFusedAllreduce(const FusedBucket& b, const Response& r,
                       Requests& requests);

}  // namespace perseus
