"""Runs every check_* function of a worker module on this rank.

Usage: run_checks.py MODULE OUT_DIR. Writes OUT_DIR/rank<R>.json mapping each
check to "ok" or its failure, and OUT_DIR/rank<R>.seconds.json each check's
wall time (tests/harness.py collects them). Checks run in name order on every rank; each
check must issue the same collectives on every rank whatever its outcome.
"""

import importlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_module(name, out_dir):
    """Runs the module's checks on this rank, writing its results into out_dir
    (tests/workers/keras_version_worker.py runs them beside other work)."""
    if os.environ.get("PERSEUS_TEST_DEVICE"):
        # Every array submitted through _core goes on that device first.
        from perseus_tf import _testing
        _testing.use_test_device()
    module = importlib.import_module(name)
    rank = module.setup()
    results, seconds = {}, {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    # For working on a few checks: a comma-separated list of substrings.
    only = [w for w in os.environ.get("PERSEUS_CHECKS_ONLY", "").split(",") if w]
    # The checks a launch runs (tests/harness.py run_checks(names=...)): exact
    # names, every one of which the module must define.
    names = [w for w in os.environ.get("PERSEUS_CHECKS_NAMES", "").split(",") if w]
    defined = sorted(n for n in dir(module) if n.startswith("check_"))
    unknown = sorted(set(names) - set(defined))
    if unknown:
        raise SystemExit(f"PERSEUS_CHECKS_NAMES: {module.__name__} has no {', '.join(unknown)}")
    for name in defined:
        if only and not any(w in name for w in only):
            continue
        if names and name not in names:
            continue
        start = time.monotonic()
        try:
            getattr(module, name)()
            results[name] = "ok"
        except Exception:  # a failed check is reported, the others still run
            results[name] = traceback.format_exc(limit=6)
        seconds[name] = round(time.monotonic() - start, 3)
        with open(path, "w") as f:  # rewritten as we go: a hang still leaves evidence
            json.dump(results, f)
        with open(os.path.join(out_dir, f"rank{rank}.seconds.json"), "w") as f:
            json.dump(seconds, f)
    teardown = getattr(module, "teardown", None)
    if teardown:
        teardown()


def main():
    run_module(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
