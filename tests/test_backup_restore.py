"""BackupAndRestore across a restart, at 2 ranks: every rank resumes from
rank 0's backup (same epoch, same weights); ranks that restored different
states refuse to train; the ranks' scratch folders are gone after exit."""

import glob
import os
import re
import sys
import tempfile

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
