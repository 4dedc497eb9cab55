"""The Keras releases tests/test_keras_versions.py runs Perseus-TF against,
besides the newest Keras 3 that the TF 2.21 venv has: the oldest Keras 3
each supported TensorFlow accepts (its wheel's `keras>=` requirement, as
perseus_tf/_keras.py lists) and tf_keras. Keras is pure Python: each is
installed with `pip install --no-deps --target .keras-versions/<name>` and
put first on the ranks' PYTHONPATH, over the TF 2.21 venv, with the NumPy
that TensorFlow release allowed (TF 2.16 and 2.17 need NumPy 1). Beside
NumPy 1 goes an ml_dtypes built for it: TF 2.21 accepts ml_dtypes 0.5.1 to
1.0, and from 0.7.0 ml_dtypes needs NumPy 2 (its import fails on NumPy 1).

    python tests/keras_versions.py install DIR    (what `make keras-versions` runs)
"""

import os
import subprocess
import sys

# name: (pip requirements, extra environment, the TF release it stands for)
VERSIONS = {
    "keras-3.0.5": (["keras==3.0.5", "dm-tree==0.1.10", "numpy==1.26.4", "ml_dtypes==0.5.4"],
                    {}, "2.16"),
    "keras-3.2.1": (["keras==3.2.1", "numpy==1.26.4", "ml_dtypes==0.5.4"], {}, "2.17"),
    "keras-3.5.0": (["keras==3.5.0", "numpy==2.0.2"], {}, "2.18 and 2.19"),
    # Each side of a backport's end: 3.7 is the last Keras 3 whose fit does
    # not scale its loss by the replicas itself (keras_backports' fit-loss
    # patch ends at 3.8), 3.8 the first that does.
    "keras-3.7.0": (["keras==3.7.0"], {}, "2.18 to 2.20"),
    "keras-3.8.0": (["keras==3.8.0"], {}, "2.18 to 2.20"),
    # Between the ends: the last Keras 3 whose metric variables are not
    # on-read (keras_backports' metric patch ends at 3.10).
    "keras-3.9.2": (["keras==3.9.2"], {}, "2.18 to 2.20"),
    "keras-3.10.0": (["keras==3.10.0"], {}, "2.20"),
    "keras-3.12.0": (["keras==3.12.0"], {}, "2.21"),
    # Keras 2 on TF >= 2.16: tf.keras is tf_keras under TF_USE_LEGACY_KERAS=1.
    "tf_keras": (["tf_keras==2.21.*"], {"TF_USE_LEGACY_KERAS": "1"}, "2.21"),
}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, ".keras-versions")


def path(name):
    return os.path.join(DIR, name)


def env(name):
    """The ranks' environment for a version: its folder first on PYTHONPATH."""
    requirements, extra, _ = VERSIONS[name]
    return dict(extra, PYTHONPATH=ROOT + os.pathsep + path(name))


def install(directory):
    for name, (requirements, _, _) in VERSIONS.items():
        target = os.path.join(directory, name)
        stamp = os.path.join(target, ".installed")
        if os.path.exists(stamp) and open(stamp).read() == repr(requirements):
            continue
        subprocess.run(["rm", "-rf", target], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", target] + requirements, check=True)
        with open(stamp, "w") as f:
            f.write(repr(requirements))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "install":
        raise SystemExit(__doc__)
    install(sys.argv[2])
