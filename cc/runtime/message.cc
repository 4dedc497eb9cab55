#include "cc/runtime/message.h"

#include <cstring>
#include <stdexcept>

namespace perseus {
namespace {

class Writer {
 public:
  explicit Writer(std::vector<char>* out) : out_(out) {}
  template <typename T>
  void Put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    out_->insert(out_->end(), p, p + sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_->insert(out_->end(), s.begin(), s.end());
  }
  void PutInts(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) Put<int64_t>(x);
  }

 private:
  std::vector<char>* out_;
};

class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  T Get() {
    Need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string GetString() {
    uint32_t n = Get<uint32_t>();
    Need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> GetInts() {
    uint32_t n = Get<uint32_t>();
    Need(static_cast<size_t>(n) * sizeof(int64_t));
    std::vector<int64_t> v(n);
    for (uint32_t i = 0; i < n; ++i) v[i] = Get<int64_t>();
    return v;
  }

 private:
  void Need(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) {
      throw std::runtime_error("truncated negotiation message");
    }
  }
  const char* p_;
  const char* end_;
};

}  // namespace

std::vector<char> EncodeCycle(const CycleMessage& msg) {
  std::vector<char> out;
  Writer w(&out);
  w.Put<uint8_t>(msg.shutdown ? 1 : 0);
  w.Put<uint32_t>(static_cast<uint32_t>(msg.requests.size()));
  for (const TensorMeta& m : msg.requests) {
    w.PutString(m.name);
    w.Put<int32_t>(static_cast<int32_t>(m.op));
    w.Put<int32_t>(static_cast<int32_t>(m.dtype));
    w.Put<int32_t>(static_cast<int32_t>(m.reduce_op));
    w.PutInts(m.shape);
    w.Put<int32_t>(m.root);
    w.Put<double>(m.prescale);
    w.Put<double>(m.postscale);
    w.PutInts(m.splits);
    w.Put<int32_t>(m.group);
    w.Put<int32_t>(m.compression);
    w.Put<int32_t>(m.flags);
    if (m.flags & kMetaRejected) w.PutString(m.rejected);
  }
  return out;
}

CycleMessage DecodeCycle(const char* data, size_t size) {
  Reader r(data, size);
  CycleMessage msg;
  msg.shutdown = r.Get<uint8_t>() != 0;
  uint32_t n = r.Get<uint32_t>();
  msg.requests.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    TensorMeta m;
    m.name = r.GetString();
    m.op = static_cast<OpType>(r.Get<int32_t>());
    m.dtype = static_cast<DataType>(r.Get<int32_t>());
    m.reduce_op = static_cast<ReduceOp>(r.Get<int32_t>());
    m.shape = r.GetInts();
    m.root = r.Get<int32_t>();
    m.prescale = r.Get<double>();
    m.postscale = r.Get<double>();
    m.splits = r.GetInts();
    m.group = r.Get<int32_t>();
    m.compression = r.Get<int32_t>();
    m.flags = r.Get<int32_t>();
    if (m.flags & kMetaRejected) m.rejected = r.GetString();
    msg.requests.push_back(std::move(m));
  }
  return msg;
}

const char* CompressionName(int32_t code) {
  switch (code) {
    case kCompressNone: return "none";
    case kCompressFp16: return "float16";
    case kCompressMixed: return "mixed";
    case kCompressTopk: return "top-k";
    case kCompressDownsample: return "downsample";
    default: return "unknown";
  }
}

}  // namespace perseus
