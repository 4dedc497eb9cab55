"""Horovod's module path `horovod.tensorflow`, for scripts moved by
replacing `horovod` with `perseus_tf.horovod` in their imports:

    import perseus_tf.horovod.tensorflow as hvd         # was: import horovod.tensorflow as hvd
    import perseus_tf.horovod.tensorflow.keras as hvd   # was: import horovod.tensorflow.keras as hvd

Every name is the one of `perseus_tf.horovod` (the same objects, not
copies), and its submodules are the shim's own.
"""

import sys

from perseus_tf import horovod as _shim
from perseus_tf.horovod import *  # noqa: F401,F403 - the whole public surface
from perseus_tf.horovod import __all__  # noqa: F401

# `import perseus_tf.horovod.tensorflow.elastic` (and the others) must give
# the shim's module, not a second copy of it.
for _name in ("elastic", "compression", "functions", "sync_batch_norm"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"{_shim.__name__}.{_name}"]


def __getattr__(name):
    return getattr(_shim, name)
