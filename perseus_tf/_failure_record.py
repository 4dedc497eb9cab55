"""The failure record a rank leaves for perseusrun.

When a rank started by perseusrun (PERSEUS_FAILURE_RECORD=1) ends with an
uncaught exception, one line goes to its standard error before the
traceback: RECORD_PREFIX and a JSON object with the rank, when it failed,
the exception's first line, and the ranks the runtime blamed for its own
failure (dead, stopped, or gone). perseusrun keeps the line off the screen
and uses the records to name the rank that failed first, not merely the
one that exited first.
"""

import json
import os
import sys
import time

RECORD_PREFIX = b"\x1ePERSEUS-FAILURE-RECORD "
ENV = "PERSEUS_FAILURE_RECORD"
_MAX_ERROR = 400


def make_record(rank: int, exc_type, exc) -> bytes:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    error = f"{exc_type.__name__}: {first_line}" if first_line else exc_type.__name__
    record = {"rank": rank, "time": time.time(), "error": error[:_MAX_ERROR], "culprits": []}
    core = sys.modules.get("perseus_tf._core")
    failure = core.first_failure() if core is not None else None
    if failure:
        # The runtime's own failure came first: its time, and whom it blamed.
        record["time"] = failure["time"]
        record["culprits"] = list(failure["culprits"])
    return RECORD_PREFIX + json.dumps(record).encode() + b"\n"


def parse_record(segment: bytes):
    """The record in one output line, or None if the line is not one."""
    at = segment.find(RECORD_PREFIX)
    if at < 0:
        return None
    try:
        record = json.loads(segment[at + len(RECORD_PREFIX):].decode())
        return {"rank": int(record["rank"]), "time": float(record["time"]),
                "error": str(record.get("error", "")),
                "culprits": [int(r) for r in record.get("culprits", [])]}
    except (ValueError, KeyError, TypeError):
        return None


def install() -> None:
    if os.environ.get(ENV) != "1" or getattr(sys.excepthook, "_perseus", False):
        return
    try:
        rank = int(os.environ.get("PERSEUS_RANK", ""))
    except ValueError:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, KeyboardInterrupt):
            try:
                sys.stderr.flush()  # the record starts a line of its own
                os.write(2, make_record(rank, exc_type, exc))
            except Exception:  # pylint: disable=broad-except
                pass  # the record is a courtesy; the traceback still follows
        previous(exc_type, exc, tb)

    hook._perseus = True
    sys.excepthook = hook
