"""Horovod's module path `horovod.tensorflow.keras`: this module is
`perseus_tf.horovod.keras` itself (the same module object, so its classes
and callbacks are the shim's), with its submodules under this name too."""

import sys

from perseus_tf.horovod import keras as _keras_shim

for _name in ("callbacks", "elastic"):
    sys.modules[f"{__name__}.{_name}"] = getattr(_keras_shim, _name)
sys.modules[__name__] = _keras_shim
