"""Runs Horovod's own TF2 example scripts on Perseus-TF, changed only where
the porting notes in docs/horovod.md say (the import line, and the Keras 3 edits that
Horovod itself needs on TF >= 2.16), and prints how long each took.

    python tools/run_horovod_examples.py HOROVOD_SRC/examples/tensorflow2 [-np 2]
        [--mnist-steps 200] [--mnist-epochs 2] [--only NAME]

It also runs Horovod's elastic TF2 examples, from HOROVOD_SRC/examples/elastic/
tensorflow2, under an elastic perseusrun (-np N --min-np N-1 --max-np N);
with --kill-one, once rank 0 has printed its first progress line the worker
on the last slot is SIGKILLed, and the example must go on at N-1 ranks
(perseusrun's reset line is checked and shown).

The scripts are not part of this repository (they are Horovod's): point the
tool at a Horovod checkout. The MNIST examples get synthetic data in MNIST's
shapes (no download): images whose label is the brightest of ten fixed
patterns, so accuracy rises as the model learns. Their step counts are
Horovod's (10000 // size steps; 24 epochs of 500 // size steps), which take
many minutes on a CPU: --mnist-steps and --mnist-epochs cap them (0: no cap);
the cap is printed with the times.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLES = {
    "tensorflow2_synthetic_benchmark.py": ["--model", "MobileNetV2", "--batch-size", "8",
                                           "--num-warmup-batches", "2",
                                           "--num-batches-per-iter", "2", "--num-iters", "3",
                                           "--no-cuda"],
    "tensorflow2_keras_synthetic_benchmark.py": ["--model", "MobileNetV2", "--batch-size", "8",
                                                 "--num-batches-per-iter", "2",
                                                 "--num-iters", "3", "--no-cuda"],
    "tensorflow2_mnist.py": [],
    "tensorflow2_keras_mnist.py": [],
    # Horovod's elastic examples (examples/elastic/tensorflow2, beside the
    # examples_dir), under an elastic perseusrun.
    "../elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py": [
        "--model", "MobileNetV2", "--batch-size", "8", "--num-warmup-batches", "2",
        "--num-batches-per-iter", "2", "--num-iters", "3", "--num-batches-per-commit", "2",
        "--no-cuda"],
    "../elastic/tensorflow2/tensorflow2_mnist_elastic.py": [],
    "../elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py": [],
}

# Runs before the example (python -c PRELUDE script args...): synthetic
# MNIST, the optional caps, then the script as __main__.
PRELUDE = r"""
import os, runpy, sys
import numpy as np
import tensorflow as tf

def _synthetic_mnist(path=None):
    rng = np.random.default_rng(0)
    patterns = rng.random((10, 28, 28))
    images = (rng.random((12000, 28, 28)) * 128).astype(np.uint8)
    labels = rng.integers(0, 10, 12000)
    images = np.minimum(images + (patterns[labels] * 127).astype(np.uint8), 255).astype(np.uint8)
    return (images, labels.astype(np.uint8)), (images[:1000], labels[:1000].astype(np.uint8))

tf.keras.datasets.mnist.load_data = _synthetic_mnist
steps, epochs = int(os.environ["EXAMPLE_MAX_STEPS"]), int(os.environ["EXAMPLE_MAX_EPOCHS"])
if steps:
    _take = tf.data.Dataset.take
    tf.data.Dataset.take = lambda self, n, name=None: _take(self, min(int(n), steps))
if epochs:
    import keras
    _fit = keras.Model.fit
    def _capped_fit(self, *args, **kwargs):
        kwargs["epochs"] = min(kwargs.get("epochs", 1), epochs)
        return _fit(self, *args, **kwargs)
    keras.Model.fit = _capped_fit
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def port(source: str, keras3: bool) -> str:
    """The import line, and on Keras 3 the edits Horovod's examples need there."""
    text = source.replace("import horovod.tensorflow.keras as hvd",
                          "import perseus_tf.horovod.keras as hvd")
    text = text.replace("import horovod.tensorflow as hvd", "import perseus_tf.horovod as hvd")
    text = re.sub(r"^import horovod$", "import perseus_tf.horovod as horovod", text, flags=re.M)
    if keras3:
        text = text.replace("opt.variables()", "opt.variables")
        text = re.sub(r",\s*experimental_run_tf_function=False", "", text)
        text = text.replace("checkpoint-{epoch}.h5", "checkpoint-{epoch}.keras")
        # Keras 3 optimizers have learning_rate (a variable), not lr, and
        # keras.backend has no set_value (the elastic examples' reset hooks).
        text = re.sub(r"tf\.keras\.backend\.set_value\(([^,]+),\s*(.+)\)$", r"\1.assign(\2)",
                      text, flags=re.M)
        text = re.sub(r"\.lr\b", ".learning_rate", text)
    return text


PROGRESS = re.compile(r"Step #|Iter #|Epoch 1/|\d+/\d+ \[")


def _worker_pid(slot: str):
    """The pid of the elastic worker on `slot` (its PERSEUS_ELASTIC_WORKER)."""
    wanted = f"PERSEUS_ELASTIC_WORKER={slot}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    return None


def run_example(cmd, work, env, kill_one, np_):
    """(exit status, stdout, stderr); kill_one: SIGKILL the last slot's
    worker when a rank shows progress first."""
    if not kill_one:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        return proc.returncode, proc.stdout, proc.stderr
    import signal
    import threading
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    out, killed = [], False
    for line in proc.stdout:
        out.append(line)
        if not killed and PROGRESS.search(line):
            pid = _worker_pid(f"localhost:{np_ - 1}")
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed = True
    proc.wait()
    reader.join(10)
    return proc.returncode, "".join(out), "".join(err)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples_dir")
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--mnist-steps", type=int, default=200)
    parser.add_argument("--mnist-epochs", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only this example (repeatable)")
    parser.add_argument("--kill-one", action="store_true",
                        help="elastic examples: SIGKILL the last slot's worker once rank 0 "
                             "shows progress; the example must finish at one rank fewer")
    args = parser.parse_args()
    import importlib.metadata
    try:
        keras3 = importlib.metadata.version("keras").startswith("3.")
    except importlib.metadata.PackageNotFoundError:
        keras3 = False
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, extra in EXAMPLES.items():
            if args.only and os.path.basename(name) not in args.only:
                continue
            with open(os.path.normpath(os.path.join(args.examples_dir, name))) as f:
                ported = port(f.read(), keras3)
            name = os.path.basename(name)
            script = os.path.join(work, name)
            with open(script, "w") as f:
                f.write(ported)
            mnist = "mnist" in name
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                EXAMPLE_MAX_STEPS=str(args.mnist_steps if mnist else 0),
                EXAMPLE_MAX_EPOCHS=str(args.mnist_epochs if mnist else 0))
            elastic = "elastic" in name
            launch = ["-np", str(args.np)]
            if elastic:
                launch += ["--min-np", str(max(1, args.np - 1)), "--max-np", str(args.np),
                           "-H", f"localhost:{args.np}", "--blacklist-cooldown", "3600"]
            cmd = [sys.executable, "-m", "perseus_tf.runner", *launch, "--",
                   sys.executable, "-c", PRELUDE, script, *extra]
            start = time.monotonic()
            code, out, err = run_example(cmd, work, env, elastic and args.kill_one, args.np)
            seconds = time.monotonic() - start
            plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
            first = "[0]" if not elastic else "[localhost:"
            tail = [l for l in re.split(r"[\r\n]+", plain) if l.startswith(first)][-2:]
            tail += [l for l in err.splitlines() if "reset" in l]
            cap = (f"steps<={args.mnist_steps}, epochs<={args.mnist_epochs}" if mnist
                   else " ".join(extra))
            if elastic and args.kill_one and code == 0 and \
                    f"reset 1: {args.np - 1} ranks; left: localhost:{args.np - 1}" not in err:
                code = "no reset"
            rows.append((name, code, seconds, cap, tail))
            if code != 0:
                sys.stderr.write(out[-3000:] + err[-5000:])
    print(f"| example | ranks | exit | seconds | settings | last lines (rank 0's, perseusrun's) |")
    print("|---|---|---|---|---|---|")
    for name, code, seconds, cap, tail in rows:
        lines = " / ".join(l.split("] ", 1)[-1].strip()[:80] for l in tail)
        print(f"| {name} | {args.np} | {code} | {seconds:.1f} | {cap} | {lines} |")
    return 0 if all(code == 0 for _, code, *_ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
