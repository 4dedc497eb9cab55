// Every kernel of kernels.cu, listed once: kernels.cc numbers and resolves
// them from this list, and the stand-in driver (cc/testing/fake_cuda.cc)
// runs them from it. tests/test_cuda.py fails when it and kernels.cu's
// `extern "C" __global__` functions differ.
//
// X(Name, function, synchronising): kName indexes the kernel in kernels.cc;
// synchronising kernels call __syncthreads, so the stand-in runs their
// blocks' threads at once.
#pragma once

#define PERSEUS_CUDA_KERNELS(X)                                                              \
  X(ToHalf, perseus_to_half, false)                                                         \
  X(FromHalf, perseus_from_half, false)                                                     \
  X(ScaleF32, perseus_scale_f32, false)                                                     \
  X(ScaleF64, perseus_scale_f64, false)                                                     \
  X(ScaleF16, perseus_scale_f16, false)                                                     \
  X(ScaleBf16, perseus_scale_bf16, false)                                                   \
  X(ScaleI32, perseus_scale_i32, false)                                                     \
  X(ScaleI64, perseus_scale_i64, false)                                                     \
  X(ScaleU8, perseus_scale_u8, false)                                                       \
  X(ScaleI8, perseus_scale_i8, false)                                                       \
  X(ScaleU16, perseus_scale_u16, false)                                                     \
  X(ScaleI16, perseus_scale_i16, false)                                                     \
  X(SumChunks, perseus_sum_chunks, false)                                                   \
  X(NonFiniteF32, perseus_nonfinite_f32, false)                                             \
  X(NonFiniteF64, perseus_nonfinite_f64, false)                                             \
  X(NonFinite16, perseus_nonfinite_16, false)                                               \
  X(BatchedCopy, perseus_batched_copy, false)                                               \
  X(TopkKeys, perseus_topk_keys, false)                                                     \
  X(TopkThreshold, perseus_topk_threshold, true)                                            \
  X(TopkEqualFlags, perseus_topk_equal_flags, false)                                        \
  X(TopkChosenFlags, perseus_topk_chosen_flags, false)                                      \
  X(TopkWrite, perseus_topk_write, false)                                                   \
  X(ScanBlockSums, perseus_scan_block_sums, true)                                           \
  X(ScanOffsets, perseus_scan_offsets, false)                                               \
  X(ScanApply, perseus_scan_apply, true)                                                    \
  X(Spin, perseus_spin, false)
