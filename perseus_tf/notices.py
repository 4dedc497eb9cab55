"""Warnings that every rank would give alike.

Rank 0 gives them (every rank when the rank is not known yet), without the
line of source Python's warnings quote: for a warning raised inside
Perseus-TF that line is library code, which tells the reader nothing. They
are PerseusWarning, a UserWarning, so `warnings.filterwarnings` can silence
them by class.
"""

import sys
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


def install_setting_error_hook():
    """A bad setting (perseus_tf.config.ConfigError: a PERSEUS_* variable or
    an option out of range, a launcher's variables that disagree) that ends
    the script is one line from rank 0, "perseus-tf: <what and the valid
    range>", not a traceback from every rank: the message says all there is
    to fix, and every rank would print the same. The other ranks exit as
    silently, with the same status (1). Other exceptions go to the hook
    that was there before."""
    if getattr(sys.excepthook, "_perseus_settings", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        from perseus_tf.config.settings import ConfigError
        if not issubclass(exc_type, ConfigError):
            previous(exc_type, exc, tb)
            return
        if job_rank() in (None, 0):
            sys.stderr.write(f"perseus-tf: {exc}\n")
            sys.stderr.flush()

    hook._perseus_settings = True
    sys.excepthook = hook
