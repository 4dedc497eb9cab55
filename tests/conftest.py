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

# Ranks of this test process's launches fork from servers that imported
# TensorFlow once (zygote.py): the servers live in SCRATCH and end with it.
# PERSEUS_TEST_ZYGOTES=0 starts every rank as a plain process.
import zygote  # noqa: E402
if os.environ.get(zygote.FOLDER_VARIABLE) == "0":
    ZYGOTES = ""
    os.environ.pop(zygote.FOLDER_VARIABLE)
else:
    ZYGOTES = zygote.make_folder(SCRATCH)
    os.environ[zygote.FOLDER_VARIABLE] = ZYGOTES


def pytest_sessionfinish(session, exitstatus):
    if ZYGOTES:
        cpu = zygote.stop_servers(ZYGOTES)
        # tools/run_tests.py adds it to the job's CPU seconds.
        if os.environ.get("PERSEUS_TEST_EXTRA_CPU"):
            with open(os.environ["PERSEUS_TEST_EXTRA_CPU"], "w") as f:
                f.write(f"{cpu:.2f}\n")
    shutil.rmtree(SCRATCH, ignore_errors=True)
