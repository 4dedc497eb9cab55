"""Runs the real-model matrix (tests/model_matrix.py) outside pytest.

    python tools/model_matrix.py            # the pairwise cover CI runs
    python tools/model_matrix.py --full     # every combination (hours)

Prints one line per item: launch, item, ok or the failure, seconds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from model_matrix import PAIRWISE, env_for, full, launch_id  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every combination, not the cover")
    args = parser.parse_args()
    launches = list(full()) if args.full else PAIRWISE
    failed = 0
    for np_, settings, items in launches:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TF_CPP_MIN_LOG_LEVEL="2", **env_for(settings))
        with tempfile.TemporaryDirectory() as out:
            path = os.path.join(out, "results.json")
            cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(np_), "--",
                   sys.executable, os.path.join(ROOT, "tests", "workers", "model_matrix_worker.py"),
                   path] + items
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=1800)
            results = json.load(open(path)) if os.path.exists(path) else {}
        for item in items:
            outcome = results.get(item, "did not report")
            failed += outcome != "ok"
            print(f"{launch_id((np_, settings, items))} {item}: "
                  f"{outcome if outcome == 'ok' else 'FAILED ' + outcome[-500:]} "
                  f"({results.get(item + ':seconds', '?')} s)", flush=True)
        if proc.returncode and not results:
            print(proc.stderr[-2000:], file=sys.stderr)
    print(f"{len(launches)} launches, {failed} failed items")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
