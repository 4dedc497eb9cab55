"""Warnings that every rank would give alike.

Rank 0 gives them (every rank when the rank is not known yet), without the
line of source Python's warnings quote: for a warning raised inside
Perseus-TF that line is library code, which tells the reader nothing. They
are PerseusWarning, a UserWarning, so `warnings.filterwarnings` can silence
them by class.
"""

import warnings


class PerseusWarning(UserWarning):
    """A warning from Perseus-TF (notices.warn)."""


def job_rank():
    """This process's rank: the runtime's once initialized, else what its
    launcher set (perseusrun, mpirun, Slurm, ...), else None."""
    try:
        from perseus_tf import _native
        if _native.is_initialized():
            return _native.topology()["rank"]
    except Exception:  # the native library is missing or not built: not our concern here
        pass
    try:
        from perseus_tf.config import find_contract
        contract = find_contract()
        return contract.rank if contract is not None else 0
    except Exception:  # a broken contract is reported by init, with its reason
        return None


def warn(message):
    """Warns on rank 0 only, naming Perseus-TF instead of a line of its source."""
    if job_rank() not in (None, 0):
        return
    warnings.warn_explicit(message, PerseusWarning, "Perseus-TF", 0)
