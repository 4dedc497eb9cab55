"""BackupAndRestore across a restart, at 2 ranks: every rank resumes from
rank 0's backup (same epoch, same weights); ranks that restored different
states refuse to train; the ranks' scratch folders are gone after exit."""

import glob
import json
import os
import re
import sys
import tempfile

import numpy as np
import pytest

from harness import WORKERS, launch

WORKER = os.path.join(WORKERS, "backup_worker.py")


def tf_keras_major():
    import importlib.metadata
    try:
        return int(importlib.metadata.version("keras").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 2


def _scratch():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "perseus-rank*")))


def test_every_rank_resumes_from_the_same_backup_and_scratch_is_removed():
    before = _scratch()
    with tempfile.TemporaryDirectory() as top:
        directory = os.path.join(top, "backup")
        crash = launch(2, [sys.executable, WORKER, "crash", directory], timeout=240)
        assert crash.returncode == 0 and crash.stdout.count("CRASHED") == 2, crash.stderr[-3000:]
        assert os.path.exists(os.path.join(directory, "training_metadata.json")) or \
            os.listdir(directory), "rank 0 wrote no backup"
        resume = launch(2, [sys.executable, WORKER, "resume", directory], timeout=240)
        out = resume.stdout + resume.stderr
        found = re.findall(r"RESUMED rank (\d) epochs (\[[\d, ]*\]) checksum (\S+)", out)
        assert resume.returncode == 0 and len(found) == 2, out[-3000:]
        (_, epochs0, sum0), (_, epochs1, sum1) = sorted(found)
        assert epochs0 == epochs1 and sum0 == sum1, found
        assert not epochs0.startswith("[0"), found  # resumed, not started over
        skew_dir = os.path.join(top, "skew")
        launch(2, [sys.executable, WORKER, "crash", skew_dir], timeout=240)
        skew = launch(2, [sys.executable, WORKER, "skew", skew_dir], timeout=240,
                      env={"PERSEUS_STALL_TIMEOUT_SECONDS": "15"})
        out = skew.stdout + skew.stderr
        assert skew.returncode != 0, out[-3000:]
        if tf_keras_major() == 3:
            assert out.count("REFUSED") == 2, out[-3000:]
            assert "restored different training states" in out and "rank 1: epoch" in out, \
                out[-3000:]
        else:
            # Keras 2 restores optimizer slots only where a backup was found:
            # the ranks' variable creations (broadcasts from rank 0) differ,
            # which the stall timeout names.
            assert "stalled" in out and re.search(r"rank [01] has submitted it; rank [01] has not", out), \
                out[-3000:]
    assert _scratch() - before == set(), _scratch() - before


def _steps_and_weights(result):
    out = result.stdout + result.stderr
    found = re.findall(r"STEPS rank (\d) (.*) weights (.*)", out)
    assert result.returncode == 0 and len(found) == 2, out[-3000:]
    return {int(r): (steps, [float(v) for v in w.split()]) for r, steps, w in found}


def test_resume_at_the_saved_step_trains_as_an_uninterrupted_run():
    """save_freq in batches: a job killed in the middle of epoch 1 resumes
    after the last saved batch of that epoch (not at its start, not at the
    next epoch), skips the batches it had trained, and ends with the weights
    of a run that was never interrupted."""
    before = _scratch()
    with tempfile.TemporaryDirectory() as top:
        whole = _steps_and_weights(
            launch(2, [sys.executable, WORKER, "whole", os.path.join(top, "whole")], timeout=240))
        directory = os.path.join(top, "backup")
        crash = launch(2, [sys.executable, WORKER, "crash-step", directory], timeout=240)
        assert crash.returncode == 0 and crash.stdout.count("CRASHED") == 2, crash.stderr[-3000:]
        resumed = _steps_and_weights(
            launch(2, [sys.executable, WORKER, "resume-step", directory], timeout=240))
    # 64 rows, global batch 16: 4 batches an epoch; the backup was taken
    # after epoch 1's batch 1 (the sixth batch, save_freq=3).
    assert whole[0][0] == "[(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), " \
        "(3, [0, 1, 2, 3])]", whole
    for rank in (0, 1):
        assert resumed[rank][0] == "[(1, [2, 3]), (2, [0, 1, 2, 3]), (3, [0, 1, 2, 3])]", resumed
        assert resumed[rank][1] == resumed[0][1]
        np.testing.assert_allclose(resumed[rank][1], whole[0][1], rtol=1e-5, atol=1e-6)
    assert _scratch() - before == set(), _scratch() - before


def test_a_backup_torn_between_its_two_writes_is_refused_or_replaced_by_the_previous_one():
    """Keras 3 writes a backup's weights, then its metadata (epoch, batch):
    a job stopped between the two leaves new weights beside old metadata.
    The restore refuses that backup on every rank, naming it; with
    double_checkpoint=True it resumes from the previous backup instead, and
    still ends with the weights of an uninterrupted run. (Keras 2 writes one
    TF checkpoint whose index goes last: nothing to tear.)"""
    if tf_keras_major() == 2:
        pytest.skip("Keras 2's BackupAndRestore writes one TF checkpoint, index last")
    before = _scratch()
    with tempfile.TemporaryDirectory() as top:
        directory = os.path.join(top, "torn")
        crash = launch(2, [sys.executable, WORKER, "crash-torn", directory], timeout=240)
        assert crash.returncode == 0 and crash.stdout.count("CRASHED") == 2, crash.stderr[-3000:]
        refused = launch(2, [sys.executable, WORKER, "resume-torn", directory], timeout=240)
        out = refused.stdout + refused.stderr
        assert refused.returncode != 0 and out.count("REFUSED") == 2, out[-3000:]
        assert f"the backup in {directory} is torn" in out and "epoch 0, batch 2" in out, \
            out[-3000:]
        # A damaged weights file with no digest to check (a backup of an
        # older Perseus-TF): Keras' own error, with the file named.
        weights = os.path.join(directory, "latest.weights.h5")
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
        metadata = os.path.join(directory, "training_metadata.json")
        with open(metadata) as f:
            saved = json.load(f)
        saved.pop("perseus_weights_sha256")
        with open(metadata, "w") as f:
            json.dump(saved, f)
        damaged = launch(2, [sys.executable, WORKER, "resume-torn", directory], timeout=240)
        out = damaged.stdout + damaged.stderr
        assert damaged.returncode != 0 and out.count("REFUSED") == 2, out[-3000:]
        assert f"could not read its backup {weights}" in out, out[-3000:]
        whole = _steps_and_weights(
            launch(2, [sys.executable, WORKER, "whole", os.path.join(top, "whole")], timeout=240))
        directory = os.path.join(top, "double")
        crash = launch(2, [sys.executable, WORKER, "crash-torn-double", directory], timeout=240)
        assert crash.returncode == 0 and crash.stdout.count("CRASHED") == 2, crash.stderr[-3000:]
        resume = launch(2, [sys.executable, WORKER, "resume-double", directory], timeout=240)
        assert "Resuming from the previous backup" in resume.stdout + resume.stderr
        resumed = _steps_and_weights(resume)
    for rank in (0, 1):
        # The previous backup was taken after epoch 0's third batch.
        assert resumed[rank][0] == "[(0, [3]), (1, [0, 1, 2, 3]), (2, [0, 1, 2, 3]), " \
            "(3, [0, 1, 2, 3])]", resumed
        np.testing.assert_allclose(resumed[rank][1], whole[0][1], rtol=1e-5, atol=1e-6)
    assert _scratch() - before == set(), _scratch() - before
