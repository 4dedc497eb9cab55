"""Benchmarks of the Perseus-TF runtime, runnable with one command.

    python -m benchmarks.collectives allreduce [--np N] [--min-bytes 4K] [--max-bytes 256M]
                                         [--iters K] [--warmup W] [--dtype float32]
                                         [--csv PATH]

    python -m benchmarks.collectives gradients (--profile NAME | --tensors N [--tensor-bytes SIZE])
                                         [--np N] [--iters K] [--warmup W] [--csv PATH]

``allreduce`` compares, for tensor sizes doubling from --min-bytes to
--max-bytes, our path (one tensor submitted to the runtime and waited on:
negotiation, stream dispatch, copy into the output, Gloo allreduce) with a
raw contiguous Gloo allreduce of the same size on a dedicated context (the
ceiling). Rank 0 prints an nccl-tests style table.

``gradients`` replays one training step's gradient communication: every
tensor of a model profile (perseus_tf/profiles, e.g. resnet50) submitted in
backprop (reverse) order as an in-place float32 average, then all waited on,
against one raw contiguous Gloo allreduce of the same number of elements.
It also reports the runtime's own counters (control bytes, buckets, cycles)
per step.

Started outside perseusrun (no PERSEUS_RANK in the environment), the
benchmark relaunches itself through perseusrun with -np N ranks. Only the
TensorFlow-free pybind11 module is used, so TensorFlow need not be installed.

One module per benchmark (allreduce.py, gradients.py); a new subcommand
adds a module with a ``run_<name>`` function and its parser in cli.py. The
helpers for launching, timing and table printing are in common.py.
"""

from benchmarks.collectives.allreduce import *  # noqa: F401,F403 (the benchmarks' names)
from benchmarks.collectives.cli import build_parser, main  # noqa: F401
from benchmarks.collectives.common import *  # noqa: F401,F403
from benchmarks.collectives.gradients import *  # noqa: F401,F403
