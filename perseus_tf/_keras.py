"""Which Keras a script trains with, and whether Perseus-TF supports it.

Perseus-TF patches a few private parts of Keras (see each module of
perseus_tf/strategy/ and perseus_tf/horovod/keras/). Those parts change
between releases, so the supported releases are declared here, checked
when PerseusStrategy() or hvd.init() starts, and tested at both ends in CI
(tests/test_keras_versions.py):

- Keras 3.0 to 3.15, the package `keras` on TF 2.16 to 2.21. The oldest
  Keras 3 each TF accepts: TF 2.16: 3.0, 2.17: 3.2, 2.18 and 2.19: 3.5,
  2.20: 3.10, 2.21: 3.12.
- Keras 2.15, TF 2.15's `keras` (also `tf.keras`).
- tf_keras 2.15 to 2.21: Keras 2 on TF 2.16 and later (`tf.keras` under
  TF_USE_LEGACY_KERAS=1, or `import tf_keras`).

A Keras older than the range is refused with one line naming the range; a
Keras 3 newer than the newest tested runs with one warning line. Where an
old Keras lacks what one feature needs, that feature says so when used
(`require`), and everything else works.

The patches and the Keras internals each reaches, by release, are the table
of perseus_tf/patches.py (PATCHES); a patch whose target a supported release
lacks fails there, naming it.

Several Keras may be loaded at once (TF 2.16+ with tf_keras installed has
both): every patch is applied to each Keras the script may train with
(`in_use`) that its row applies to.
"""

import importlib
import os
import re
import sys

from perseus_tf import notices

KERAS3_OLDEST = (3, 0)
KERAS3_NEWEST_TESTED = (3, 15)
KERAS2_OLDEST = (2, 15)

# The oldest Keras 3 each TensorFlow release accepts (its wheel's requirement).
OLDEST_KERAS3_FOR_TF = {(2, 16): (3, 0), (2, 17): (3, 2), (2, 18): (3, 5), (2, 19): (3, 5),
                        (2, 20): (3, 10), (2, 21): (3, 12)}

SUPPORTED = ("Keras 3.0 to 3.15 (TF 2.16 to 2.21), Keras 2.15 (TF 2.15), "
             "tf_keras 2.15 to 2.21")


class KerasVersionError(RuntimeError):
    """A Keras release Perseus-TF does not support, or a feature this Keras
    release cannot give."""


def _version_tuple(text):
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = re.match(r"\d*", piece).group()   # "0rc1" -> 0
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _text(version):
    return ".".join(str(v) for v in version)


class Flavour:
    """One Keras package a script may train with.

    Attributes:
      package: the imported module (`keras` or `tf_keras`).
      name: its import name.
      version: its release as a tuple, e.g. (3, 8, 0).
      major: 2 or 3.
    """

    def __init__(self, package):
        self.package = package
        self.name = package.__name__
        self.version = _version_tuple(getattr(package, "__version__", "0"))
        self.major = self.version[0] if self.version else 0

    def src(self, dotted):
        """A private module of this Keras, e.g. src("engine.data_adapter")."""
        return importlib.import_module(f"{self.name}.src.{dotted}")

    def at_least(self, *version):
        return self.version >= tuple(version)

    def __repr__(self):
        return f"{self.name} {_text(self.version)}"


def legacy_requested():
    return os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


def in_use(imported_only=False):
    """The Keras packages this process may train with, Keras 3 first:
    `keras` (Keras 3, or Keras 2 on TF 2.15), and tf_keras when it is
    imported or TF_USE_LEGACY_KERAS asks for it. imported_only: only those
    the process has imported already (nothing is imported)."""
    found = []
    if not imported_only or "keras" in sys.modules:
        try:
            import keras
            found.append(Flavour(keras))
        except ImportError:  # pragma: no cover - every supported TF has one
            pass
    if "tf_keras" in sys.modules or (legacy_requested() and not imported_only):
        try:
            import tf_keras
            found.append(Flavour(tf_keras))
        except ImportError:
            pass
    return found


def keras3():
    """The Keras 3 flavour, or None (TF 2.15)."""
    return next((f for f in in_use() if f.major == 3), None)


def keras2():
    """The Keras 2 flavours in use (TF 2.15's keras, tf_keras)."""
    return [f for f in in_use() if f.major == 2]


def optimizer_classes(flavour=None):
    """The Keras optimizer base classes a script may train with: those of
    each Keras in use (or of `flavour`), and their `legacy` ones."""
    flavours = in_use() if flavour is None else [flavour]
    classes = []
    for module in [f.package.optimizers for f in flavours]:
        for holder in (module, getattr(module, "legacy", None)):
            cls = getattr(holder, "Optimizer", None)
            if isinstance(cls, type) and cls not in classes:
                classes.append(cls)
    return tuple(classes)


_warned = set()


def check_supported(where, imported_only=False):
    """Refuses, with one line, a Keras older than the supported range; warns
    once about a Keras 3 newer than the newest tested. `where` names the
    entry point (e.g. "PerseusStrategy()"); imported_only: check only the
    Keras packages already imported (hvd.init(): a script of TF ops alone
    does not pay for importing Keras)."""
    for flavour in in_use(imported_only):
        if flavour.major == 3:
            oldest, newest = KERAS3_OLDEST, KERAS3_NEWEST_TESTED
        elif flavour.major == 2:
            oldest, newest = KERAS2_OLDEST, None
        else:
            raise KerasVersionError(
                f"{where}: {flavour!r} is not supported (supported: {SUPPORTED}); "
                f"install one of those, e.g. pip install 'keras>=3.0,<3.16'")
        if flavour.version < oldest:
            raise KerasVersionError(
                f"{where}: {flavour!r} is older than Perseus-TF supports ({SUPPORTED}); "
                f"upgrade it: pip install '{flavour.name}>={_text(oldest)}'")
        if newest and flavour.version[:2] > newest and flavour.name not in _warned:
            _warned.add(flavour.name)
            notices.warn(
                f"Perseus-TF: {flavour!r} is newer than the newest Keras it was tested with "
                f"({_text(newest)}); if training fails inside Keras, pin "
                f"'{flavour.name}<{newest[0]}.{newest[1] + 1}'")


def require(flavour, version, feature):
    """Raises KerasVersionError when `flavour` is older than `version`:
    `feature` (what the user asked for) needs that Keras."""
    if flavour.version < tuple(version):
        raise KerasVersionError(
            f"Perseus-TF: {feature} needs Keras {_text(version)} or newer; this process "
            f"has {flavour!r}. Upgrade it (pip install '{flavour.name}>={_text(version)}'), "
            f"or leave this feature out: everything else works on {flavour!r}")
