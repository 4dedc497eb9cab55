"""Reports where this rank believes it is (no TensorFlow).

Usage: slurm_topology.py OUT_DIR [--allreduce]

Writes OUT_DIR/report.<pid>.json (a file, as srun cuts lines longer than
1 KiB into pieces): what perseus_tf.config reads from the environment
(rank, size, local and cross ranks, store address, port, secret, source),
the launcher variables it was read from, and with --allreduce the sum of
every rank's (rank + 1) through the native runtime, which proves the ranks
found each other. tests/test_slurm.py starts it under srun and perseusrun.
"""

import dataclasses
import json
import os
import sys

import numpy as np

from perseus_tf import config

SHOWN = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NUM_TASKS",
         "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID",
         "SLURM_JOB_NODELIST", "PERSEUS_RANK", "HOROVOD_HOSTNAME")


def main():
    report = {"env": {k: os.environ.get(k) for k in SHOWN}}
    try:
        topology = dataclasses.asdict(config.load_topology())
        topology["secret"] = topology["secret"].hex()
        report["topology"] = topology
    except config.ConfigError as err:
        report["error"] = str(err)
    if "--allreduce" in sys.argv[1:] and "error" not in report:
        from perseus_tf import _native
        from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core
        _native.init()
        mine = np.array([_native.topology()["rank"] + 1.0], np.float32)
        handle = _core.submit(OP_ALLREDUCE, mine, "slurm.sum", DTYPE_CODES["float32"],
                              reduce_op=0, output=np.empty_like(mine))
        report["sum"] = float(handle.wait()[0][0])
        _native.shutdown()
    path = os.path.join(sys.argv[1], f"report.{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(path + ".tmp", path)


if __name__ == "__main__":
    main()
