"""Everything tests/test_keras_versions.py checks on one Keras release, in
one launch (one TensorFlow import per rank, not one per kind of check):

    keras_version_worker.py OUT_DIR MODEL_ITEM SCRIPT...

On this rank, in order:
1. every check of checks_strategy.py (run_checks.run_module), results in
   OUT_DIR/checks/rank<R>.json as harness.run_checks reads them;
2. README's quick-start scripts, one after another, as `python train_*.py`
   would run them: OUT_DIR/quickstart/rank<R>.json records, for each script,
   the sha256 of the trained model's weights and the Keras that trained it;
3. one real model under PerseusStrategy against one process
   (model_matrix_worker.run_item): rank 0 writes {MODEL_ITEM: "ok" or the
   failure} to OUT_DIR/model.json.
A step that raises is recorded and the later steps still run, on every rank.
"""

import hashlib
import json
import os
import runpy
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Imported first: it gives TensorFlow one logical CPU per rank (its
# one-process reference's replicas), as checks_strategy's setup does.
import model_matrix_worker  # noqa: E402
import numpy as np  # noqa: E402
import run_checks  # noqa: E402


def run_scripts(out, scripts):
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
    return results


def main():
    out, item, scripts = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = os.environ.get("PERSEUS_RANK", "0")
    for part in ("checks", "quickstart"):
        os.makedirs(os.path.join(out, part), exist_ok=True)
    run_checks.run_module("checks_strategy", os.path.join(out, "checks"))
    try:
        quick = run_scripts(out, scripts)
    except Exception:  # noqa: BLE001 - reported, and the model still runs
        quick = {"error": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, "quickstart", f"rank{rank}.json"), "w") as f:
        json.dump(quick, f)
    import checks_strategy
    import perseus_tf.horovod as hvd
    hvd.init()
    try:
        outcome = model_matrix_worker.run_item(item, checks_strategy.STRATEGY)
    except Exception:  # noqa: BLE001
        outcome = traceback.format_exc()[-3000:]
    if hvd.rank() == 0:
        with open(os.path.join(out, "model.json"), "w") as f:
            json.dump({item: outcome}, f)


if __name__ == "__main__":
    main()
