"""Forwarding the ranks' output: each line (or \\r-ended progress update) of a
rank's pipe goes to perseusrun's stdout or stderr as soon as it is complete,
prefixed with ``[rank] ``; TensorFlow's C++ log noise is dropped unless the
user asked for it, and the ranks' failure records (_failure_record) are taken
out for the supervisor. remote.py forwards a rank's output under mpirun with
the same code.
"""

import os
import re
import threading

from perseus_tf import _failure_record


# TensorFlow's C++ log lines: absl's format (TF >= 2.16, "I0000
# 00:00:1795595146.043765 1234 file.cc:31] ...", seconds since the epoch
# before absl is initialised) and TF 2.15's ("2026-11-25 08:00:00.123: I
# tensorflow/...cc:182] ..."), and absl's note that it logs to stderr.
_TF_LOG_LINE = re.compile(
    rb"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] "
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) \S+:\d+\] )")
_ABSL_NOTE = b"WARNING: All log messages before absl::InitializeLog() is called"
# Errors TensorFlow logs at every start on a machine without a GPU (or with
# a CUDA build beside another): noise, not the user's problem.
# And oneDNN's note, at the first float16 op on a CPU without AVX-512, that
# TF uses its own (Eigen) kernels instead: nothing fails.
_TF_BENIGN_ERRORS = (b"failed call to cuInit", b"Unable to register cuDNN factory",
                     b"Unable to register cuFFT factory", b"Unable to register cuBLAS factory",
                     b"oneDNN supports DT_HALF only on platforms with AVX-512")


def tf_log_noise(segment: bytes) -> bool:
    """True for a line perseusrun keeps off the screen by default: TF's C++
    info and warning lines, the start-up errors of a machine without a GPU,
    and absl's note about logging before InitializeLog. Real errors (E/F
    lines about anything else) and everything else the rank prints stay."""
    if segment.startswith(_ABSL_NOTE):
        return True
    m = _TF_LOG_LINE.match(segment)
    if not m:
        return False
    severity = m.group(1) or m.group(2)
    if severity in (b"I", b"W"):
        return True
    return severity == b"E" and any(text in segment for text in _TF_BENIGN_ERRORS)


# A segment ends at \n, or at a \r not followed by \n (a \r\n pair stays
# together; a \r that ends a read ends its segment).
_SEGMENT_END = re.compile(rb"\n|\r(?!\n)")


def _segments(buffer: bytes, pending=None):
    """Splits buffer into complete segments, each ending in \n or \r (a
    \r\n pair stays together); returns (segments, the unfinished rest).

    pending: a list of earlier unfinished pieces, joined to the first
    segment only once it completes, so a long line costs time linear in its
    length however many reads bring it."""
    pending = pending or []
    ends = [m.end() for m in _SEGMENT_END.finditer(buffer)]
    if not ends:
        return [], pending + [buffer] if buffer else pending
    segments = [b"".join(pending) + buffer[:ends[0]]]
    segments += [buffer[a:b] for a, b in zip(ends, ends[1:])]
    rest = buffer[ends[-1]:]
    return segments, [rest] if rest else []


def _take_records(segments: list, on_record) -> list:
    """The segments with ranks' failure records (_failure_record) taken
    out and handed to on_record."""
    kept = []
    for segment in segments:
        record = _failure_record.parse_record(segment)
        if record is None:
            kept.append(segment)
            continue
        on_record(record)
        before = segment[:segment.find(_failure_record.RECORD_PREFIX)]
        if before:
            kept.append(before + b"\n")
    return kept


# One lock per output stream, shared by every rank's forwarder and by
# perseusrun's own messages (write_line), and whether what was last written
# there ended a line: a rank's progress bar ends its updates in \r only.
_locks = {}
_locks_guard = threading.Lock()
_mid_line = {}


def stream_lock(stream) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(id(stream), threading.Lock())


def write_line(stream, text: str) -> None:
    """One of perseusrun's own lines on `stream`, whole and on a line of its
    own: never inside a rank's line, nor after a rank's \r-ended update."""
    with stream_lock(stream):
        lead = "\n" if _mid_line.get(id(stream)) else ""
        try:
            stream.write(lead + text + "\n")
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass
        _mid_line[id(stream)] = False


def forward_lines(pipe, stream, prefix: bytes, lock: threading.Lock,
                   quiet: bool = False, on_record=None) -> None:
    """Copies pipe to stream, each line or \\r-ended update (a progress bar
    redrawing itself) as soon as it is complete, each starting with prefix.
    quiet: drop TensorFlow's C++ log noise (tf_log_noise). on_record: takes
    the ranks' failure records, which are not shown."""
    # Write bytes when the stream allows it, so that output that is not
    # valid in our locale's encoding passes through untouched.
    raw = getattr(stream, "buffer", None)
    broken = False
    pending = []  # unfinished pieces of the current segment
    after_cr = False  # the last segment sent ended in \\r
    fd = pipe.fileno()
    with pipe:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if chunk:
                segments, pending = _segments(chunk, pending)
            else:
                segments, pending = ([b"".join(pending) + b"\n"] if pending else []), []
            if on_record is not None:
                segments = _take_records(segments, on_record)
            if quiet:
                segments = [seg for seg in segments if not tf_log_noise(seg)]
            parts = []
            for segment in segments:
                # A \\r\\n split across two reads: the \\n ends the line
                # already shown, it needs no prefix of its own.
                parts.append(segment if after_cr and segment == b"\n" else prefix + segment)
                after_cr = segment.endswith(b"\r")
            if parts and not broken:
                data = b"".join(parts)
                with lock:
                    try:
                        if raw is not None:
                            raw.write(data)
                            raw.flush()
                        else:
                            stream.write(data.decode("utf-8", "replace"))
                            stream.flush()
                        _mid_line[id(stream)] = not data.endswith(b"\n")
                    except (BrokenPipeError, ValueError):
                        # Our reader went away (e.g. `perseusrun ... | head`);
                        # keep draining, or the rank would block on a full pipe.
                        broken = True
            if not chunk:
                return
