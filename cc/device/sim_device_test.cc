#include "cc/device/sim_device.h"

#include <cstring>
#include <string>

#include "cc/testing/check.h"

namespace perseus {
namespace {

bool Mentions(const std::vector<std::string>& hazards, const std::string& what) {
  for (const auto& h : hazards) {
    if (h.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST(SimDeviceFlagsAReadOfAnotherStreamsWriteWithoutAWait) {
  SimDevice& dev = SimDevice::Get();
  dev.TakeHazards();
  const int a = dev.CreateStream(), b = dev.CreateStream();
  char* p = static_cast<char*>(dev.Alloc(64));
  char* q = static_cast<char*>(dev.Alloc(64));
  dev.Launch(a, "producer", {}, {{p, 64}}, [p] { std::memset(p, 1, 64); });
  dev.Launch(b, "consumer", {{p, 64}}, {{q, 64}}, [p, q] { std::memcpy(q, p, 64); });
  dev.Synchronize(dev.Record(b));
  dev.Synchronize(dev.Record(a));
  // Whichever ran first, the other finds the access it did not know of.
  auto hazards = dev.TakeHazards();
  CHECK(Mentions(hazards, "'consumer' before it knew that the write by stream") ||
        Mentions(hazards, "'producer' before it knew that a read by stream"));
  CHECK(Mentions(hazards, "a missing wait on an event"));
  dev.Free(p);
  dev.Free(q);
  dev.DestroyStream(a);
  dev.DestroyStream(b);
}

TEST(SimDeviceAcceptsTheSameWorkOrderedByAnEvent) {
  SimDevice& dev = SimDevice::Get();
  dev.TakeHazards();
  const int a = dev.CreateStream(), b = dev.CreateStream();
  char* p = static_cast<char*>(dev.Alloc(64));
  char* q = static_cast<char*>(dev.Alloc(64));
  dev.Launch(a, "producer", {}, {{p, 64}}, [p] { std::memset(p, 1, 64); });
  dev.StreamWait(b, dev.Record(a));
  dev.Launch(b, "consumer", {{p, 64}}, {{q, 64}}, [p, q] { std::memcpy(q, p, 64); });
  bool told = false;
  dev.LaunchHostFunc(b, [&told] { told = true; });
  dev.Synchronize(dev.Record(b));
  CHECK(told);
  dev.HostRead(q, 64, "result");
  CHECK(q[63] == 1);
  auto hazards = dev.TakeHazards();
  CHECK(hazards.empty());
  dev.Free(p);
  dev.Free(q);
  CHECK(dev.TakeHazards().empty());
  dev.DestroyStream(a);
  dev.DestroyStream(b);
}

TEST(SimDeviceFlagsAHostReadBeforeTheWorkIsKnownToHaveFinished) {
  SimDevice& dev = SimDevice::Get();
  dev.TakeHazards();
  const int a = dev.CreateStream();
  char* p = static_cast<char*>(dev.Alloc(8));
  dev.Launch(a, "kernel", {}, {{p, 8}}, [p] { std::memset(p, 2, 8); });
  dev.HostRead(p, 8, "early read");
  dev.Synchronize(dev.Record(a));
  CHECK(Mentions(dev.TakeHazards(), "the host read memory in 'early read' while 'kernel'"));
  dev.HostRead(p, 8, "late read");
  CHECK(dev.TakeHazards().empty());
  // A write by another stream while a stream may still read: write after read.
  dev.Launch(a, "reader", {{p, 8}}, {}, [] {});
  const int b = dev.CreateStream();
  dev.Launch(b, "overwrite", {}, {{p, 8}}, [p] { std::memset(p, 3, 8); });
  dev.Synchronize(dev.Record(b));
  dev.Synchronize(dev.Record(a));
  CHECK(Mentions(dev.TakeHazards(), "a missing wait on an event"));  // either order
  dev.Free(p);
  dev.DestroyStream(a);
  dev.DestroyStream(b);
}

}  // namespace
}  // namespace perseus
