"""Builds Perseus-TF: the Python package plus its native code, compiled
against the TensorFlow installed in the target environment.

Install with `pip install .` once TensorFlow is installed: pip builds in an
isolated environment with pyproject.toml's build requirements (setuptools,
wheel, pybind11), and tools/build_native.py asks the target environment's
TensorFlow for its headers and flags. `pip install --no-build-isolation -e .`
(what `make` runs) builds with what the environment already has.

Supported: TensorFlow 2.15 to 2.21 (the build stops on an older one:
tools/build_native.py), Keras 3.0 to 3.15, Keras 2.15 and tf_keras 2.15 to
2.21 (checked when PerseusStrategy() or hvd.init() starts:
perseus_tf/_keras.py). TensorFlow and Keras are not install requirements:
the user's own TensorFlow (tensorflow, tensorflow-cpu or
tensorflow[and-cuda]) and the Keras it brings are built against.
"""

import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildNative(build_ext):
    """Compiles libperseus_core.so, _perseus_ops_tfX_Y.so and _core with tools/build_native.py."""

    def build_extensions(self):
        sys.path.insert(0, os.path.join(HERE, "tools"))
        import build_native

        expected = os.path.dirname(os.path.abspath(self.get_ext_fullpath("perseus_tf._core")))
        built = build_native.build(expected)
        if getattr(self, "editable_mode", False) or self.inplace:
            # `pip install -e .`: the package is imported from the source tree,
            # so all three libraries belong there too (setuptools would only
            # carry over the one extension it knows about), each renamed into
            # place so that a job running from this tree keeps its mapping.
            for path in built:
                build_native.place(path, os.path.join(HERE, "perseus_tf"))


setup(
    name="perseus-tf",
    version="0.1.0",
    description="Fast data-parallel TensorFlow training across processes (AIACC/Perseus ideas)",
    packages=find_packages(include=["perseus_tf", "perseus_tf.*"]),
    package_data={"perseus_tf": ["profiles/*.json"]},
    ext_modules=[Extension("perseus_tf._core", sources=[])],
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["perseusrun=perseus_tf.runner:main"]},
    python_requires=">=3.11",
    classifiers=["Programming Language :: Python :: 3.11", "Operating System :: POSIX :: Linux"],
    install_requires=["numpy", "pybind11"],
)
