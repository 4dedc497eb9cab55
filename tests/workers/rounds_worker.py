"""Two rounds of the runtime in one job (tests/test_faults.py): every rank
init()s, reduces and shuts down; then the even ranks do it again in the same
process, while each odd rank's place is taken by a new process (started by
the old one, with its environment) that has run no round."""

import os
import subprocess
import sys

import numpy as np

from perseus_tf import _core, _native

R = int(os.environ["PERSEUS_RANK"])
REPLACEMENT = sys.argv[1:] == ["replacement"]


def one_round(label, value):
    _native.init()
    out, _ = _core.submit(_native.OP_ALLREDUCE, np.full(3, value, np.float32), label,
                          _native.DTYPE_CODES["float32"]).wait()
    round_ = _core.stats()["round"]
    _native.shutdown()
    print(f"rank {R} {label} {out[0]:g} round {round_}" +
          (" (replacement)" if REPLACEMENT else ""), flush=True)


if REPLACEMENT:
    one_round("second", 100.0 * (R + 1))
    sys.exit(0)
one_round("first", R + 1.0)
if R % 2:
    sys.exit(subprocess.run([sys.executable, os.path.abspath(__file__), "replacement"]).returncode)
one_round("second", 100.0 * (R + 1))
