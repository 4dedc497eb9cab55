import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# What the tests and the ranks they start make through `tempfile` (saved
# models, TensorBoard logs, checkpoints, TF's autograph sources, pytest's own
# tmp_path) goes under one folder of this run, removed when the run ends,
# failed or not. Ranks inherit it through TMPDIR.
SCRATCH = tempfile.mkdtemp(prefix="ptest-")
# Searchable by all, as /tmp is: daemons a test starts (munged) refuse a
# socket below a directory others cannot search.
os.chmod(SCRATCH, 0o711)
os.environ["TMPDIR"] = SCRATCH
tempfile.tempdir = SCRATCH


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SCRATCH, ignore_errors=True)
