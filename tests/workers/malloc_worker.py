"""Prints, as JSON, whether a malloc of 1 MiB and of 64 MiB is a fresh mmap
once PerseusStrategy has distributed and read a dataset (as `fit` does).

glibc's mallinfo2() counts the mmapped chunks ("hblks"): a malloc that maps
adds one. tests/test_malloc.py runs this with and without
PERSEUS_MALLOC_MMAP_THRESHOLD=0.
"""

import ctypes
import json

import perseus_tf
import tensorflow as tf
from perseus_tf import _malloc


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def maps(size):
    """1 when malloc(size) is served by a fresh mapping, 0 from the heap."""
    before = libc.mallinfo2().hblks
    p = libc.malloc(size)
    during = libc.mallinfo2().hblks
    libc.free(p)
    return during - before


strategy = perseus_tf.PerseusStrategy()
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(2))
seen = [int(tf.reduce_sum(strategy.experimental_local_results(x)[0])) for x in dataset]
# Twice each, so that glibc's dynamic rule (when not frozen) has seen a free.
for size in (1 << 20, 64 << 20):
    maps(size)
print("RESULT " + json.dumps({
    "tf_freezes_malloc": _malloc.tf_freezes_malloc(), "batches": seen,
    "maps_1mib": maps(1 << 20), "maps_64mib": maps(64 << 20)}))
perseus_tf.shutdown()
