"""Checks an install in one command: `perseusrun -np 2 python -m perseus_tf.selfcheck`.

Every rank sums a small tensor through the TensorFlow op library and the
runtime (rank r contributes r + 1), compares it with the expected sum and
broadcasts rank 0's values; rank 0 prints one line naming the Perseus-TF and
TensorFlow versions. A wrong result, or a rank that cannot start, fails the
job with a message on every rank (exit status 1)."""

import importlib.metadata
import sys


def main():
    import tensorflow as tf

    import perseus_tf

    perseus_tf.init()
    rank, size = perseus_tf.rank(), perseus_tf.size()
    total = perseus_tf.allreduce(tf.fill([4], float(rank + 1)), op=perseus_tf.Sum).numpy()
    want = size * (size + 1) / 2
    shared = perseus_tf.broadcast(tf.constant([7.0 + rank]), root_rank=0).numpy()
    if list(total) != [want] * 4 or list(shared) != [7.0]:
        print(f"perseus-tf self-check FAILED on rank {rank}: allreduce gave {list(total)} "
              f"(want {want} each), broadcast gave {list(shared)} (want [7.0])",
              file=sys.stderr, flush=True)
        return 1
    if rank == 0:
        try:
            version = importlib.metadata.version("perseus-tf")
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed: run from a source tree)"
        print(f"perseus-tf {version} on TensorFlow {tf.__version__}: allreduce over {size} "
              f"rank{'s' if size != 1 else ''} ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
