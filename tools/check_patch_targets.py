"""Every target of perseus_tf/patches.py against Keras releases CI does not run.

CI checks the patches' targets on the Keras releases of tests/keras_versions.py
(the ends of each TensorFlow's range, tf_keras) and on the venvs' own. A new
Keras release, or one between those, is checked here: each release is
installed with `pip install --no-deps --target DIR/<version>`, put first on
the path of one process per release, and the process lists the patches that
apply to it and any target it lacks.

    python tools/check_patch_targets.py DIR 3.1.1 3.3.3 3.4.1 ...

Prints one line per release (the patches applied, or what is missing) and
exits 1 when a target is missing anywhere. Keras 3.0 to 3.4 need NumPy 1:
pass --numpy1, which installs numpy 1.26.4 beside them.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json
from perseus_tf import _keras, patches
flavours = _keras.in_use()
print(json.dumps({
    "keras": [repr(f) for f in flavours],
    "applies": [p.name for p in patches.PATCHES
                if any(patches.applies(p, f) for f in flavours)],
    "missing": [[name, repr(f), target, why]
                for name, f, target, why in patches.missing_targets(flavours)]}))
"""


def _install(directory, *requirements):
    stamp = os.path.join(directory, ".installed")
    if os.path.exists(stamp) and open(stamp).read() == " ".join(requirements):
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    directory, *requirements], check=True)
    with open(stamp, "w") as f:
        f.write(" ".join(requirements))


def main(argv):
    numpy1 = "--numpy1" in argv
    args = [a for a in argv if a != "--numpy1"]
    if len(args) < 2:
        raise SystemExit(__doc__)
    cache, versions = os.path.abspath(args[0]), args[1:]
    extra = []
    if numpy1:
        extra = [os.path.join(cache, "numpy1")]
        # (ml_dtypes from 0.7.0 needs NumPy 2: tests/keras_versions.py)
        _install(extra[0], "numpy==1.26.4", "ml_dtypes==0.5.4")
    failed = False
    for version in versions:
        target = os.path.join(cache, version)
        _install(target, f"keras=={version}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, target] + extra),
                   TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            print(f"keras {version}: the probe failed: {proc.stderr.strip()[-500:]}")
            failed = True
            continue
        found = json.loads(lines[-1])
        if found["missing"]:
            failed = True
            for name, flavour, where, why in found["missing"]:
                print(f"keras {version}: patch {name} lacks {where} in {flavour} ({why})")
        else:
            print(f"keras {version}: every target found; applies {', '.join(found['applies'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
