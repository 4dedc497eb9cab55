"""PerseusStrategy's preemption and restart (strategy/keras_preempt.py):
Keras fit with BackupAndRestore stops on every rank after the same batch
when one rank gets SIGTERM, and the job resumes at that batch: by hand at a
fixed size, or by itself under an elastic perseusrun at a new size (smaller
when the preempted slot leaves, larger when discovery adds one). A rank that
dies instead makes an elastic job restart from its last backup. Each run's
final weights equal one uninterrupted process's (the same global batch
every step) to 1e-6, and the batches trained are the epochs' in order.
"""

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from harness import ROOT, WORKERS, rank_env

PERSEUSRUN = [sys.executable, "-m", "perseus_tf.runner"]
WORKER = [sys.executable, os.path.join(WORKERS, "preempt_worker.py")]
# fp32 allreduce: compared with one process, fp16 would differ by its rounding.
# The ranks compare notices after every batch, so that a stop falls where the
# test says (the first test keeps a pace-based interval).
ENV = {"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_PREEMPTION_CHECK_SECONDS": "0",
       "GLOO_TIMEOUT_SECONDS": "30",
       "PERSEUS_STALL_TIMEOUT_SECONDS": "120"}
ALL_STEPS = [(e, b) for e in range(3) for b in range(4)]


def _run(launch, out, save_freq, event="", env=None, timeout=420):
    cmd = (launch + ["--"] if launch else []) + WORKER + \
        [str(out), str(out) + "-backup", str(save_freq), event]
    return subprocess.run(cmd, env=rank_env(dict(ENV, **(env or {}))), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no interruption: the weights every run must end with."""
    out = tmp_path_factory.mktemp("reference")
    proc = _run([], out, "epoch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "final-0.json") as f:
        return np.array(json.load(f)["weights"])


def _steps(out):
    with open(os.path.join(out, "steps.txt")) as f:
        rows = [line.split() for line in f if line.strip()]
    return [(int(e), int(b), int(n), float(t)) for e, b, n, t in rows]


def _finals(out, size, reference, text):
    finals = sorted(glob.glob(os.path.join(out, "final-*.json")))
    assert len(finals) == size, (finals, text[-3000:])
    for name in finals:
        with open(name) as f:
            final = json.load(f)
        assert final["size"] == size, (name, final["size"])
        np.testing.assert_allclose(final["weights"], reference, rtol=0, atol=1e-6, err_msg=name)


def _resume_seconds(steps):
    """From the last step before the restart to the first after it."""
    for (_, _, n0, t0), (_, _, n1, t1) in zip(steps, steps[1:]):
        if n1 != n0:
            return round(t1 - t0, 1)
    return None


def test_sigterm_stops_every_rank_after_the_same_batch_and_a_rerun_resumes_there(
        tmp_path, reference):
    # Batches of at least 0.1 s, compared about every 0.3 s: rank 0 proposes
    # a number of batches from its pace, so the stop falls a few batches
    # after the signal, the same one on both ranks.
    launch, env = PERSEUSRUN + ["-np", "2"], {"PERSEUS_PREEMPTION_CHECK_SECONDS": "0.3",
                                              "PREEMPT_WORKER_SLEEP": "0.1"}
    first = _run(launch, tmp_path, "epoch", "term:1:1:1", env)
    text = first.stdout + first.stderr
    assert first.returncode == 75, text[-3000:]
    found = re.search(r"\[1\] perseus: rank 1: got SIGTERM; every rank stopped after epoch "
                      r"(\d) batch (\d)", text)
    assert found, text[-3000:]
    stop = (int(found.group(1)), int(found.group(2)))
    assert (1, 1) <= stop < (2, 3), stop
    assert (f"[0] perseus: rank 0: 1 rank got SIGTERM; every rank stopped after epoch {stop[0]} "
            f"batch {stop[1]}") in text, text[-3000:]
    assert (f"its backup resumes at epoch {stop[0]} step {stop[1] + 1}: run the same command "
            "again") in text, text[-2000:]
    done = ALL_STEPS[:ALL_STEPS.index(stop) + 1]
    assert [s[:2] for s in _steps(tmp_path)] == done
    # Saved by epoch, yet the backup holds the stop's batch.
    assert os.path.exists(str(tmp_path) + "-backup/perseus_preemption.json")
    second = _run(launch, tmp_path, "epoch", "term:1:1:1", env)
    text += second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert [s[:2] for s in _steps(tmp_path)] == ALL_STEPS, _steps(tmp_path)
    _finals(tmp_path, 2, reference, text)
    assert not glob.glob(str(tmp_path) + "-backup/*"), "fit's end keeps the backup"


def test_elastic_job_restarts_without_the_preempted_slot_at_the_same_step(tmp_path, reference):
    launch = PERSEUSRUN + ["-np", "4", "--min-np", "2", "-H", "localhost:4",
                           "--blacklist-cooldown", "600"]
    proc = _run(launch, tmp_path, "epoch", "term:1:1:2")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "worker localhost:2 (rank 2) was preempted (SIGTERM)" in text, text[-3000:]
    assert "reset 1: 3 ranks; left: localhost:2; resuming at epoch 1 step 2" in text, text[-3000:]
    steps = _steps(tmp_path)
    assert [s[:3] for s in steps] == [(e, b, 4 if (e, b) <= (1, 1) else 3)
                                      for e, b in ALL_STEPS], steps
    _finals(tmp_path, 3, reference, text)
    print("preempted 4 -> 3: resumed training", _resume_seconds(steps), "s after the stop")


def test_elastic_job_that_loses_a_rank_restarts_from_the_last_backup(tmp_path, reference):
    launch = PERSEUSRUN + ["-np", "4", "--min-np", "2", "-H", "localhost:4",
                           "--blacklist-cooldown", "600"]
    # Backups after every third batch: the last before the kill is after
    # epoch 1's batch 1; rank 2 dies as epoch 1's batch 3 begins, so batch 2,
    # trained at 4 ranks, is trained again at 3.
    proc = _run(launch, tmp_path, 3, "kill:1:3:2")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "worker localhost:2 (rank 2 of the last round) killed by signal SIGKILL" in text
    assert "stopping for perseusrun to restart the job from the last backup" in text
    assert "reset 1: 3 ranks; left: localhost:2" in text, text[-3000:]
    steps = _steps(tmp_path)
    assert [s[:3] for s in steps] == [(e, b, 4) for e, b in ALL_STEPS[:7]] + \
        [(e, b, 3) for e, b in ALL_STEPS[6:]], steps
    _finals(tmp_path, 3, reference, text)
    print("rank lost 4 -> 3: resumed training", _resume_seconds(steps), "s after the last step")


def test_elastic_job_grows_when_discovery_adds_a_slot(tmp_path, reference):
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/grow ]; then echo localhost:3; "
                      "else echo localhost:2; fi\n")
    script.chmod(0o755)
    launch = PERSEUSRUN + ["-np", "2", "--min-np", "2", "--max-np", "3",
                           "--host-discovery-script", str(script)]
    proc = _run(launch, tmp_path, "epoch", "grow:0:2:1")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "perseusrun has new workers for the job; every rank stopped after epoch 0 batch 2" \
        in text, text[-3000:]
    assert "reset 1: 3 ranks; joined: localhost:2; resuming at epoch 0 step 3" in text, \
        text[-3000:]
    steps = _steps(tmp_path)
    assert [s[:3] for s in steps] == [(e, b, 2 if (e, b) <= (0, 2) else 3)
                                      for e, b in ALL_STEPS], steps
    _finals(tmp_path, 3, reference, text)


def test_elastic_restart_with_no_slot_left_fails_within_the_elastic_timeout(tmp_path):
    # One worker, preempted: its slot is left out, no other slot exists.
    launch = PERSEUSRUN + ["-np", "1", "--min-np", "1", "-H", "localhost:1",
                           "--elastic-timeout", "3", "--blacklist-cooldown", "600"]
    proc = _run(launch, tmp_path, "epoch", "term:0:1:0", timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    assert "worker localhost:0 (rank 0) was preempted (SIGTERM)" in text, text[-3000:]
    assert ("elastic job failed: only 0 workers are alive, fewer than --min-np 1, for 3 s "
            "(--elastic-timeout); free slots on hosts not blacklisted: 0") in text, text[-3000:]
    assert [s[:2] for s in _steps(tmp_path)] == ALL_STEPS[:2]
