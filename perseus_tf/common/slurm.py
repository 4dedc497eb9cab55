"""Slurm's compressed host and task lists, read without Slurm's tools.

Slurm hands a job step its nodes as a compressed hostlist
(SLURM_STEP_NODELIST=`gnode[10,20,25-27]`) and the tasks on each node as a
run-length list (SLURM_STEP_TASKS_PER_NODE=`2(x3),1`). Both are expanded
here in plain Python (no `scontrol`, no TensorFlow): perseus_tf.config reads
a rank's place in an `srun` step with them, and perseusrun reads the hosts
of the allocation it runs in.

Example:
    >>> expand_hostlist("node[01-03],gpu7")
    ['node01', 'node02', 'node03', 'gpu7']
    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

import itertools
import re

# A hostlist of more names than this is a typo (node[1-10000000]), not a job.
MAX_HOSTS = 1 << 20

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _split_top_level(text, whole):
    """Splits at the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {whole!r}: brackets inside brackets at "
                                 f"position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {whole!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {whole!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_ranges(body, whole):
    """"01-03,7" -> ["01", "02", "03", "7"]: a range keeps the width of its
    first number, so zero padding survives ("08-10" gives 08, 09, 10)."""
    numbers = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise ValueError(f"hostlist {whole!r}: {item!r} in [{body}] is not a number "
                             "or a range like 1-4")
        low_text, high_text = match.groups()
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise ValueError(f"hostlist {whole!r}: range {item!r} goes down; write it "
                             "low-high")
        if high - low >= MAX_HOSTS:
            raise ValueError(f"hostlist {whole!r}: range {item!r} has more than "
                             f"{MAX_HOSTS} numbers")
        width = len(low_text)
        numbers.extend(str(n).zfill(width) for n in range(low, high + 1))
    return numbers


def _expand_name(name, whole):
    """One comma-free entry: "rack[1-2]-n[1-2]" -> rack1-n1, rack1-n2, rack2-n1,
    rack2-n2 (the first group varies slowest, as Slurm orders them)."""
    pieces = re.split(r"\[([^\]]*)\]", name)
    # pieces alternate: literal, bracket body, literal, ...
    choices = []
    for i, piece in enumerate(pieces):
        if i % 2:
            choices.append(_expand_ranges(piece, whole))
        else:
            if "[" in piece or "]" in piece:
                raise ValueError(f"hostlist {whole!r}: unbalanced brackets in {name!r}")
            choices.append([piece])
    names = ["".join(parts) for parts in itertools.product(*choices)]
    if len(names) > MAX_HOSTS:
        raise ValueError(f"hostlist {whole!r}: {name!r} names more than {MAX_HOSTS} hosts")
    return names


def expand_hostlist(hostlist):
    """Expands a Slurm hostlist into host names, in Slurm's order.

    Understands plain names, comma-separated lists, bracket groups of numbers
    and ranges (zero padding kept), and several groups in one name.

    Args:
      hostlist: e.g. "node[01-04,07],gpu3" or "rack[1-2]-n[1-2]".

    Returns:
      The names, e.g. ["node01", "node02", "node03", "node04", "node07", "gpu3"].

    Raises:
      ValueError: naming the hostlist, for empty names, unbalanced or nested
        brackets, and bracket contents that are not numbers or low-high ranges.
    """
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise ValueError(f"hostlist {hostlist!r} is empty: it must name at least one host, "
                         "e.g. node[01-04],gpu3")
    hosts = []
    for entry in _split_top_level(hostlist.strip(), hostlist):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"hostlist {hostlist!r} has an empty name between commas")
        if any(ch.isspace() for ch in entry):
            raise ValueError(f"hostlist {hostlist!r}: {entry!r} contains white space")
        hosts.extend(_expand_name(entry, hostlist))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"hostlist {hostlist!r} names more than {MAX_HOSTS} hosts")
    return hosts


def expand_tasks_per_node(text):
    """Expands Slurm's tasks-per-node list: "2(x3),1" -> [2, 2, 2, 1].

    Args:
      text: SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE: comma-separated
        counts, each optionally followed by "(xN)", N repetitions.

    Raises:
      ValueError: naming the text, when an item is not COUNT or COUNT(xN).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"tasks per node {text!r} is empty: it must look like 2(x3),1")
    counts = []
    for item in text.strip().split(","):
        match = _TASKS.fullmatch(item.strip())
        if not match:
            raise ValueError(f"tasks per node {text!r}: {item!r} is not COUNT or COUNT(xN), "
                             "as in 2(x3),1")
        count, times = int(match.group(1)), int(match.group(2) or 1)
        if times < 1 or len(counts) + times > MAX_HOSTS:
            raise ValueError(f"tasks per node {text!r}: {item!r} repeats {times} times; it "
                             f"must be from 1 to {MAX_HOSTS}")
        counts.extend([count] * times)
    return counts


# Derived store ports stay in [PORT_BASE, PORT_BASE + PORT_SPAN): above the
# well-known and registered ports most services use and below Linux's
# ephemeral range (32768-60999), so no outgoing connection holds one.
PORT_BASE = 10000
PORT_SPAN = 20000
# Slots per job: steps 0..STEPS_PER_JOB-1 of one job get distinct ports.
STEPS_PER_JOB = 20


def step_port(job_id, step_id):
    """The rendezvous port of Slurm job step `job_id`.`step_id`.

    Every task of a step computes the same port from the two numbers. Two
    steps of one job (ids below STEPS_PER_JOB apart) and two jobs whose ids
    are less than PORT_SPAN / STEPS_PER_JOB (1000) apart never share a port;
    beyond that a collision is possible, and PERSEUS_MASTER_PORT picks the
    port explicitly.
    """
    job, step = int(job_id), int(step_id)
    jobs = PORT_SPAN // STEPS_PER_JOB
    return PORT_BASE + (job % jobs) * STEPS_PER_JOB + step % STEPS_PER_JOB
