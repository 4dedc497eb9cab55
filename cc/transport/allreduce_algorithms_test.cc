#include "cc/transport/allreduce_algorithms.h"

#include <stdexcept>
#include <vector>

#include "cc/testing/check.h"

using namespace perseus;

namespace {

// One process standing in for a group: every member holds the same data, so
// an allreduce multiplies by the member count, a reduce to the leader too.
class FakeGroup : public GroupCollectives {
 public:
  explicit FakeGroup(int members) : members_(members) {}
  void Allreduce(int, void* data, size_t count, DataType dtype, ReduceOp) override {
    ++calls;
    ScaleBuffer(data, dtype, count, members_);
  }
  void Reduce(int, void* data, size_t count, DataType dtype, ReduceOp) override {
    ++calls;
    ScaleBuffer(data, dtype, count, members_);
  }
  void Broadcast(int, void*, size_t) override { ++calls; }
  int calls = 0;

 private:
  int members_;
};

}  // namespace

TEST(ChooseAllreduce) {
  AllreduceTopology one_host;
  one_host.one_host_shm = true;
  CHECK(ChooseAllreduce(1 << 30, false, one_host) == AllreduceAlgorithm::kShm);
  AllreduceTopology flat;
  CHECK(ChooseAllreduce(1 << 30, false, flat) == AllreduceAlgorithm::kFlatRing);
  AllreduceTopology hosts;
  hosts.two_level = true;
  CHECK(ChooseAllreduce(1 << 20, false, hosts) == AllreduceAlgorithm::kTwoLevel);
  CHECK(ChooseAllreduce(1 << 10, false, hosts) == AllreduceAlgorithm::kFlatRing);  // latency wins
  CHECK(ChooseAllreduce(1 << 10, true, hosts) == AllreduceAlgorithm::kTwoLevel);   // mixed
  hosts.mode = 0;
  CHECK(ChooseAllreduce(1 << 30, false, hosts) == AllreduceAlgorithm::kFlatRing);
  hosts.mode = 1;
  CHECK(ChooseAllreduce(1, false, hosts) == AllreduceAlgorithm::kTwoLevel);
}

TEST(ChooseAllreduceDoublesSmallFlatBuckets) {
  AllreduceTopology flat;
  flat.doubling_bytes = 64 << 10;
  flat.ranks = 8;
  CHECK(ChooseAllreduce(4 << 10, false, flat) == AllreduceAlgorithm::kFlatDoubling);
  CHECK(ChooseAllreduce(32, false, flat) == AllreduceAlgorithm::kFlatDoubling);
  CHECK(ChooseAllreduce(31, false, flat) == AllreduceAlgorithm::kFlatRing);  // under 4 B a rank
  CHECK(ChooseAllreduce(64 << 10, false, flat) == AllreduceAlgorithm::kFlatDoubling);
  CHECK(ChooseAllreduce((64 << 10) + 1, false, flat) == AllreduceAlgorithm::kFlatRing);
  flat.doubling_bytes = 0;  // off
  CHECK(ChooseAllreduce(4, false, flat) == AllreduceAlgorithm::kFlatRing);
  AllreduceTopology one_host;  // shared memory wins on one host
  one_host.one_host_shm = true;
  one_host.doubling_bytes = 64 << 10;
  CHECK(ChooseAllreduce(4, false, one_host) == AllreduceAlgorithm::kShm);
  AllreduceTopology hosts;  // two levels where asked for (mixed, mode 1) or large
  hosts.two_level = true;
  hosts.doubling_bytes = 64 << 10;
  hosts.ranks = 4;
  CHECK(ChooseAllreduce(4 << 10, false, hosts) == AllreduceAlgorithm::kFlatDoubling);
  CHECK(ChooseAllreduce(4 << 10, true, hosts) == AllreduceAlgorithm::kTwoLevel);
  CHECK(ChooseAllreduce(1 << 20, false, hosts) == AllreduceAlgorithm::kTwoLevel);
  hosts.mode = 1;
  CHECK(ChooseAllreduce(4 << 10, false, hosts) == AllreduceAlgorithm::kTwoLevel);
}

TEST(ChooseAllreduceForDeviceMemoryThatNcclReduces) {
  const AllreduceMemory device = AllreduceMemory::kNcclDevice;
  AllreduceTopology one_host;
  one_host.one_host_shm = true;  // shared memory is for host buffers only
  CHECK(ChooseAllreduce(1 << 30, false, one_host, device) == AllreduceAlgorithm::kNccl);
  CHECK(ChooseAllreduce(1 << 30, true, one_host, device) == AllreduceAlgorithm::kNccl);
  AllreduceTopology hosts;
  hosts.two_level = true;
  CHECK(ChooseAllreduce(1 << 30, false, hosts, device) == AllreduceAlgorithm::kNccl);
  CHECK(ChooseAllreduce(1 << 10, true, hosts, device) == AllreduceAlgorithm::kNcclTwoLevel);
  hosts.mode = 1;
  CHECK(ChooseAllreduce(1, false, hosts, device) == AllreduceAlgorithm::kNcclTwoLevel);
  hosts.mode = 0;
  CHECK(ChooseAllreduce(1 << 30, false, hosts, device) == AllreduceAlgorithm::kNccl);
  AllreduceTopology flat;  // no host groups: nothing to reduce in two levels
  flat.mode = 1;
  CHECK(ChooseAllreduce(1 << 10, true, flat, device) == AllreduceAlgorithm::kNccl);
  Timeline timeline;
  AllreduceCall call;
  bool refused = false;
  try {
    RunAllreduce(AllreduceAlgorithm::kNccl, AllreduceGroups(), call, timeline);
  } catch (const std::logic_error&) {
    refused = true;
  }
  CHECK(refused);
}

TEST(TwoLevelPipelinesChunksThroughHostAndLeaders) {
  FakeGroup host(2), leaders(3);  // 2 ranks per host, 3 hosts
  AllreduceGroups groups;
  groups.host = &host;
  groups.leaders = &leaders;
  std::vector<float> data(3 * (1 << 20) + 5, 1.0f);  // 12 MiB + : four 4 MiB chunks
  std::vector<uint16_t> half;
  AllreduceCall call;
  call.data = data.data();
  call.count = data.size();
  call.dtype = DataType::kFloat32;
  call.op = ReduceOp::kSum;
  call.half = &half;
  Timeline timeline;
  RunAllreduce(AllreduceAlgorithm::kTwoLevel, groups, call, timeline);
  CHECK_EQ(data.front(), 6.0f);
  CHECK_EQ(data.back(), 6.0f);
  CHECK_EQ(host.calls, 8);     // a reduce and a broadcast per chunk
  CHECK_EQ(leaders.calls, 4);  // one allreduce per chunk
}

TEST(MixedTwoLevelSendsFloat16BetweenHosts) {
  FakeGroup host(1), leaders(2);
  AllreduceGroups groups;
  groups.host = &host;
  groups.leaders = &leaders;
  std::vector<float> data = {0.5f, 1e-5f, 3.0f};
  std::vector<uint16_t> half;
  AllreduceCall call;
  call.data = data.data();
  call.count = data.size();
  call.dtype = DataType::kFloat32;
  call.op = ReduceOp::kSum;
  call.half_across = 2;  // the first two are gradients, scaled
  call.scale = 1024.0f;
  call.half = &half;
  Timeline timeline;
  RunAllreduce(AllreduceAlgorithm::kTwoLevel, groups, call, timeline);
  CHECK(half.size() >= data.size());  // it went through the float16 buffer
  CHECK_EQ(data[0], 1.0f);
  CHECK(data[1] > 1.9e-5f && data[1] < 2.1e-5f);  // the scale kept it out of subnormals
  CHECK_EQ(data[2], 6.0f);
}
