"""op=Adasum: adaptive summation of gradients (Maleki et al., "Scaling
Distributed Training with Adaptive Summation", MLSys 2021), with Horovod's
semantics.

Two ranks' vectors a and b combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with the dot product and squared norms accumulated in float64, and a
coefficient left at 1 where its squared norm is below sqrt(DBL_MIN). Ranks
combine pairwise in a binary tree: first (0,1), (2,3), ..., then the pairs'
results, and so on, which is what Horovod's vector-halving,
distance-doubling exchange computes. Each tensor of a grouped call has its
own coefficients, as in Horovod's fused buffers. The number of ranks must be
a power of two (Horovod refuses other sizes too). Only float16, float32 and
float64 are accepted; float32 and float64 combine in float64 and round back
at every level, float16 in float32 with the coefficients rounded to float32.

How it runs: one allgather per dtype brings every rank's tensors to every
rank, and each rank evaluates the same tree with the same operations, so all
ranks get the same result. That moves (size - 1) times the data instead of
about twice, which is fine for the 2-8 ranks Adasum is usually run on.
"""

import math
import sys

import tensorflow as tf

# Below this squared norm a coefficient stays 1 (Horovod's threshold).
MIN_SQUARED_NORM = math.sqrt(sys.float_info.min)
DTYPES = (tf.float16, tf.float32, tf.float64)


def check_size(set_size: int, process_set_id: int) -> None:
    if set_size < 1 or set_size & (set_size - 1):
        where = "the job" if process_set_id == 0 else f"process set {process_set_id}"
        raise NotImplementedError(
            f"op=Adasum needs a power-of-two number of ranks, as in Horovod; {where} has "
            f"{set_size}. Run with 2, 4, 8, ... ranks, or use op=Average")


def check_dtypes(tensors, name) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in DTYPES:
            what = f"tensor {i}" + (f" of '{name}'" if name else "")
            raise ValueError(f"op=Adasum reduces float16, float32 and float64 tensors only; "
                             f"{what} is {t.dtype.name}")


def _combine(a, b, ids, count, dtype):
    """One tree level for one pair: a and b are the flat concatenation of a
    group's tensors; ids maps each element to its tensor."""
    a64, b64 = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    dot = tf.math.unsorted_segment_sum(a64 * b64, ids, count)
    a_sq = tf.math.unsorted_segment_sum(a64 * a64, ids, count)
    b_sq = tf.math.unsorted_segment_sum(b64 * b64, ids, count)
    one = tf.ones_like(dot)
    a_coeff = tf.where(a_sq >= MIN_SQUARED_NORM, one - dot / (2.0 * a_sq), one)
    b_coeff = tf.where(b_sq >= MIN_SQUARED_NORM, one - dot / (2.0 * b_sq), one)
    a_coeff, b_coeff = tf.gather(a_coeff, ids), tf.gather(b_coeff, ids)
    if dtype == tf.float16:
        a32, b32 = tf.cast(a, tf.float32), tf.cast(b, tf.float32)
        return tf.cast(tf.cast(a_coeff, tf.float32) * a32 + tf.cast(b_coeff, tf.float32) * b32,
                       tf.float16)
    return tf.cast(a_coeff * a64 + b_coeff * b64, dtype)


def tree(rows, sizes, dtype):
    """Adasum of rows (one flat vector per rank, a power of two of them)."""
    count = len(sizes)
    ids = tf.repeat(tf.range(count), tf.stack(sizes)) if count else tf.zeros([0], tf.int32)
    while len(rows) > 1:
        rows = [_combine(rows[i], rows[i + 1], ids, count, dtype) for i in range(0, len(rows), 2)]
    return rows[0]


def grouped_adasum(tensors, allgather, set_size, prescale_factor=1.0, postscale_factor=1.0,
                   name=None, process_set_id=0):
    """Adasum of each tensor across the ranks of the set.

    allgather(tensor, name): the collective (concatenates along dimension 0).
    """
    check_size(set_size, process_set_id)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    check_dtypes(tensors, name)
    results = [None] * len(tensors)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        group = [tensors[i] for i in members]
        if prescale_factor != 1.0:
            group = [t * tf.cast(prescale_factor, dtype) for t in group]
        if set_size == 1:
            combined = group
        else:
            sizes = [tf.size(t) for t in group]
            flat = tf.concat([tf.reshape(t, [-1]) for t in group], 0)
            label = None if not name else f"{name}.adasum.{dtype.name}"
            gathered = allgather(tf.expand_dims(flat, 0), label)
            rows = tf.unstack(gathered, num=set_size)
            pieces = tf.split(tree(rows, sizes, dtype), tf.stack(sizes), num=len(group))
            combined = [tf.reshape(p, tf.shape(t)) for p, t in zip(pieces, group)]
        for i, t in zip(members, combined):
            results[i] = t * tf.cast(postscale_factor, dtype) if postscale_factor != 1.0 else t
    return results
