"""The table CI prints at its end: each phase's wall time, then the slowest
test files of each pytest pass.

    python tools/ci_report.py PHASES [--top 25] [--checks TIMES] [JUNIT_XML ...]

PHASES holds one line per phase, `NAME SECONDS STATUS [CPU_SECONDS]`, as
tools/run_tests.py writes it. Each JUnit XML file is one pytest run (`--junitxml`), and the
folder it lies in names its pass (tools/run_tests.py writes OUT/PASS/JOB.xml).
A test file's time is the sum of its test ids' times: pytest counts a module
fixture's work (a launch of ranks) in the first test that uses it, so the sum
holds the file's launches. Lanes run side by side, so a pass's summed test
time is more than the wall time it took.

TIMES (PERSEUS_CHECK_TIMES, written by tests/harness.py) lists every batched
check's wall time in each launch; --checks prints the slowest of them.

Only the standard library: it runs from the system Python before any venv
exists.
"""

import argparse
import collections
import os
import sys
import xml.etree.ElementTree as ET


def read_phases(path):
    """[(name, seconds, status, CPU seconds or None)] in the order they ran."""
    phases = []
    if not os.path.exists(path):
        return phases
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                cpu = float(parts[3]) if len(parts) >= 4 else None
                phases.append((parts[0], float(parts[1]), parts[2], cpu))
    return phases


def file_times(xml_path):
    """{test file: (seconds, test ids, failed ids)} of one JUnit XML file."""
    totals = collections.defaultdict(lambda: [0.0, 0, 0])
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        # classname is "tests.test_core" (or "test_core" when pytest's
        # rootdir is tests/): the module is its last dotted part that names a
        # test file.
        parts = case.get("classname", "").split(".")
        module = next((p for p in reversed(parts) if p.startswith("test_")), parts[-1])
        row = totals[module + ".py"]
        row[0] += float(case.get("time", "0") or 0)
        row[1] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            row[2] += 1
    return {k: tuple(v) for k, v in totals.items()}


def pass_of(xml_path):
    """The pass a JUnit file belongs to: its folder's name."""
    return os.path.basename(os.path.dirname(os.path.abspath(xml_path)))


def slowest_checks(path, top):
    """Lines for the `top` slowest batched checks recorded in `path`."""
    import json
    rows = []
    if path and os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: -r["seconds"])
    lines = [f"\n== the {min(top, len(rows))} slowest of {len(rows)} batched checks "
             f"(slowest rank) =="]
    for r in rows[:top]:
        lines.append(f"  {r['seconds']:8.1f}  {r['np']} ranks  {r['module']}.{r['check']}"
                     + (f"  [{r['env']}]" if r["env"] else ""))
    return lines


def minutes(seconds):
    return f"{seconds / 60:5.1f} min"


def report(phases, xmls, top=25, checks=None):
    lines = ["", "== CI timing: phases (wall time; CPU time of a job and all it started) =="]
    total = 0.0
    for name, seconds, status, cpu in phases:
        if name == "total":
            continue
        total += seconds
        used = f"{cpu:7.0f} s CPU" if cpu is not None else " " * 13
        lines.append(f"  {name:<40} {seconds:7.0f} s  {minutes(seconds)}  {used}  {status}")
    if phases:
        whole = next((s for n, s, _, _ in phases if n == "total"), total)
        lines.append(f"  {'total':<40} {whole:7.0f} s  {minutes(whole)}")
    passes = collections.OrderedDict()
    for path in xmls:
        if not os.path.exists(path):
            lines.append(f"  (no results in {path})")
            continue
        pname = pass_of(path)
        merged = passes.setdefault(pname, {})
        for fname, (seconds, n, bad) in file_times(path).items():
            old = merged.get(fname, (0.0, 0, 0))
            merged[fname] = (old[0] + seconds, old[1] + n, old[2] + bad)
    for pname, by_file in passes.items():
        rows = sorted(((f,) + v for f, v in by_file.items()), key=lambda r: -r[1])
        ids = sum(r[2] for r in rows)
        failed = sum(r[3] for r in rows)
        summed = sum(r[1] for r in rows)
        lines.append(f"\n== pass {pname}: {len(rows)} test files, {ids} test ids, {failed} "
                     f"failed, {summed:.0f} s of test time (lanes overlap) ==")
        lines.append(f"  {'seconds':>8}  {'ids':>4}  file (the {min(top, len(rows))} slowest)")
        for fname, seconds, n, bad in rows[:top]:
            flag = f"  {bad} FAILED" if bad else ""
            lines.append(f"  {seconds:8.1f}  {n:4d}  {fname}{flag}")
    if checks:
        lines += slowest_checks(checks, top)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phases")
    parser.add_argument("xml", nargs="*")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--checks", help="PERSEUS_CHECK_TIMES file of tests/harness.py")
    args = parser.parse_intermixed_args(argv)
    print(report(read_phases(args.phases), args.xml, args.top, args.checks))


if __name__ == "__main__":
    sys.exit(main())
