"""Runs README's quick-start scripts on this rank, one after another, as
`python train_*.py` would, and records what each trained.

Usage: quickstart_worker.py OUT_DIR SCRIPT... Writes OUT_DIR/rank<R>.json:
{script: {"weights": sha256 of the trained model's weights, "keras": the
Keras that trained it}} (tests/test_keras_versions.py compares the ranks).
"""

import hashlib
import json
import os
import runpy
import sys

import numpy as np


def main():
    out, scripts = sys.argv[1], sys.argv[2:]
    results = {}
    for script in scripts:
        names = runpy.run_path(script, run_name="__main__")
        model = names["model"]
        digest = hashlib.sha256()
        for w in model.get_weights():
            digest.update(np.ascontiguousarray(w).tobytes())
        keras = sys.modules.get(type(model).__module__.split(".")[0])
        results[os.path.basename(script)] = {
            "weights": digest.hexdigest(),
            "keras": f"{keras.__name__} {keras.__version__}"}
    rank = os.environ.get("PERSEUS_RANK", "0")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
