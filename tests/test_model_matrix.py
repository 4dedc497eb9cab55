"""Real models, real entry points, many settings (tests/model_matrix.py):
the pairwise cover of the matrix, each launch running its items on 2 or 4
ranks. Every item must finish within the launch's bound, end with trainable
weights identical on every rank, and, with compression off, equal one
process (MirroredStrategy over one logical CPU per rank) on the same global
batches to 1e-5. In the second pass of `make test` (TF 2.15, tests/tiers.py)
the smaller SECOND_VERSION set runs: every model and both entry points."""

import json
import os
import sys
import tempfile

import pytest

from harness import WORKERS, launch
from model_matrix import PAIRWISE, SECOND_VERSION, env_for, launch_id
from tiers import second_pass

WORKER = os.path.join(WORKERS, "model_matrix_worker.py")
LAUNCHES = SECOND_VERSION if second_pass() else PAIRWISE


@pytest.fixture(scope="module", params=LAUNCHES, ids=[launch_id(l) for l in LAUNCHES])
def launched(request):
    np_, settings, items = request.param
    env = env_for(settings)
    env["PERSEUS_STALL_TIMEOUT_SECONDS"] = "120"
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "results.json")
        proc = launch(np_, [sys.executable, WORKER, path] + items, env=env, timeout=400)
        results = json.load(open(path)) if os.path.exists(path) else {}
    return items, results, proc


def test_matrix_launch(launched):
    items, results, proc = launched
    failures = {i: results.get(i, "did not report") for i in items if results.get(i) != "ok"}
    assert not failures, (json.dumps(failures, indent=1)[-6000:] +
                          "\n--- output tail ---\n" + (proc.stdout + proc.stderr)[-3000:])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
