"""The long soak of the native runtime (tests/test_soak.py runs it briefly).

    python tools/soak.py --np 4 --steps 10000 [--tcp] [--seed 1]

Starts tests/workers/soak_worker.py on N local ranks under perseusrun and
prints each rank's summary: steps, collectives checked, wrong results
(must be 0), plans entered and left, seconds.
"""

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tcp", action="store_true", help="Gloo over TCP, not shared memory")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PERSEUS_SHM_ALLREDUCE"] = "0" if args.tcp else "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(args.np), "--",
           sys.executable, os.path.join(ROOT, "tests", "workers", "soak_worker.py"),
           str(args.steps), str(args.seed)]
    print(f"soak: {args.np} ranks, {args.steps} steps, seed {args.seed}, "
          f"{'TCP' if args.tcp else 'shared memory'}", flush=True)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if "SOAK" in line:
            print(line)
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
