"""Undoing what TensorFlow's tf.data does to glibc's malloc, for PerseusStrategy.

TensorFlow 2.21 (not 2.15) calls `mallopt(M_TRIM_THRESHOLD, 128 KiB)` once
per process, when it first makes a GeneratorDataset kernel
(`tensorflow::data::ApplyPython311MemoryPatch`, a fix for memory growth of
`from_generator` pipelines). Any mallopt call also turns off glibc's dynamic
thresholds: from then on every malloc of 128 KiB or more is a fresh mmap,
and its free a munmap. tf.distribute's input iterator (a MultiDeviceIterator)
is made of GeneratorDatasets, so every PerseusStrategy `fit` and
distributed dataset triggers it, although the user made no generator.

What pays for it is Eigen: TensorFlow's CPU convolutions take their packing
buffers from malloc (their tensors come from the BFC pool that importing
perseus_tf selects), so each backward convolution maps, faults in and
unmaps fresh pages. On MobileNetV2 (benchmarks/step_overlap.py, TF 2.21)
that was about 40 ms of a 540 ms step, all of the strategy's extra time over
the Horovod shim, which makes no GeneratorDataset.

`restore()` makes TensorFlow's call happen now (so that it cannot come later
and override this), then sets both thresholds to where glibc's own dynamic
rule would take them at most: blocks under PERSEUS_MALLOC_MMAP_THRESHOLD
(32 MiB by default, glibc's ceiling) come from the heap and stay there for
reuse, and the heap is trimmed when twice that is free at its top, as glibc
does. PERSEUS_MALLOC_MMAP_THRESHOLD=0 leaves TensorFlow's setting alone.
"""

import ctypes
import glob
import os
import threading

# glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

_PATCH_SYMBOL = "_ZN10tensorflow4data25ApplyPython311MemoryPatchEv"

_lock = threading.Lock()
_done = False


def tf_freezes_malloc():
    """True when the loaded TensorFlow library carries the mallopt call."""
    import tensorflow as tf
    for path in sorted(glob.glob(os.path.join(os.path.dirname(tf.__file__),
                                              "libtensorflow_cc.so*"))):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        return hasattr(lib, _PATCH_SYMBOL)
    return False


def _make_generator_dataset():
    """Builds and drops a one-device MultiDeviceIterator, eagerly: its
    GeneratorDataset kernels run TensorFlow's once-per-process mallopt.
    False when eager execution is off (TF1-style graphs): nothing runs now."""
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops
    with tf.init_scope(), tf.device("/cpu:0"):
        if not tf.executing_eagerly():
            return False
        iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(
            tf.data.Dataset.range(1), ["/cpu:0"], source_device="/cpu:0")
        del iterator
    return True


def restore(threshold):
    """Sets glibc's thresholds after TensorFlow's call (see the module
    docstring); `threshold` is the mmap threshold in bytes, 0 to do nothing.
    Returns whether it changed them. Once per process. With eager
    execution off it changes nothing: TensorFlow's call could still come
    later and freeze them again."""
    global _done
    with _lock:
        if _done or threshold == 0 or not tf_freezes_malloc():
            return False
        if not _make_generator_dataset():
            return False
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, 2 * int(threshold)) == 1 and ok
        _done = True
        return ok
