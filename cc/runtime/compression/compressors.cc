// The executor's compressors by kind, and what each puts on the wire
// (compression.h).
#include "cc/runtime/compression/compression.h"

namespace perseus {

Compressors::Compressors(const CompressionContext& context)
    : fp16_(MakeFp16Compressor(context)),
      topk_(MakeTopkCompressor(context)),
      downsample_(MakeDownsampleCompressor(context)) {}

Compressor* Compressors::For(int compression) const {
  switch (compression) {
    case kCompressFp16: return fp16_.get();
    case kCompressTopk: return topk_.get();
    case kCompressDownsample: return downsample_.get();
    default: return nullptr;
  }
}

int64_t WireBytes(const TensorMeta& m, const CompressionSettings& options, bool two_level) {
  const int64_t n = NumElements(m.shape);
  switch (m.compression) {
    case kCompressFp16:
      return 2 * n;
    case kCompressMixed:  // what crosses hosts
      return (two_level ? 2 : 4) * n;
    case kCompressTopk:
      return TopkCount(n, options.topk_ratio) * (4 + (options.topk_fp16 ? 2 : 4));
    case kCompressDownsample:
      return 4 * ((n + options.downsample_n_elements - 1) / options.downsample_n_elements);
    default:
      return n * static_cast<int64_t>(DataTypeSize(m.dtype));
  }
}

}  // namespace perseus
