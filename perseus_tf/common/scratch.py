"""Per-rank scratch directories, named after the job, so that whoever
outlives a rank can remove them.

Ranks other than 0 write Keras checkpoint and backup copies into a scratch
directory of their own (strategy/keras_files.py). A rank removes it at exit,
but a rank killed by a signal (SIGKILL, perseusrun's SIGTERM, the
parent-death signal) runs no exit handler: perseusrun removes its local
ranks' directories once every rank has exited, and remote.py its rank's on
the rank's host. Only the standard library is imported here.
"""

import glob
import os
import shutil
import tempfile


def _job_id():
    job = os.environ.get("PERSEUS_JOB_ID") or "local"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job)


def rank_scratch(rank):
    """Makes and returns a new scratch directory for `rank` of this job."""
    return tempfile.mkdtemp(prefix=f"perseus-{_job_id()}-rank{rank}-")


def remove_job_scratch(job_id, rank=None):
    """Removes the scratch directories of `job_id` (of one rank, or all)
    under this host's temporary directory; returns how many."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
    which = f"rank{rank}-" if rank is not None else "rank"
    pattern = os.path.join(tempfile.gettempdir(), f"perseus-{safe}-{which}*")
    removed = 0
    for path in glob.glob(pattern):
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed
