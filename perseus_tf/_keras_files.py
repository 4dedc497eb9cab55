"""Keras 3 callbacks that write files write them on rank 0 only.

Saving still runs on every rank (it reads metrics and variables, which are
collectives), but ranks other than 0 write into a private scratch directory.
Keras 2 does this itself for strategies in multi-worker mode; Keras 3 does
not, so PerseusStrategy installs these small redirections when size > 1.
"""

import os
import tempfile

_installed = False


def install(rank):
    global _installed
    if rank == 0 or _installed:
        return
    try:
        import keras
    except ImportError:
        return
    if not keras.__version__.startswith("3."):
        return  # Keras 2 uses the strategy's should_checkpoint / task id
    scratch = tempfile.mkdtemp(prefix=f"perseus-rank{rank}-")
    callbacks = keras.callbacks

    get_path = callbacks.ModelCheckpoint._get_file_path

    def _get_file_path(self, *args, **kwargs):
        path = get_path(self, *args, **kwargs)
        return os.path.join(scratch, "checkpoints", os.path.basename(path))

    callbacks.ModelCheckpoint._get_file_path = _get_file_path

    tb_init = callbacks.TensorBoard.__init__

    def tensorboard_init(self, log_dir="logs", *args, **kwargs):
        tb_init(self, os.path.join(scratch, "tensorboard"), *args, **kwargs)

    callbacks.TensorBoard.__init__ = tensorboard_init

    br_init = callbacks.BackupAndRestore.__init__

    def backup_init(self, backup_dir, *args, **kwargs):
        br_init(self, os.path.join(scratch, "backup"), *args, **kwargs)

    callbacks.BackupAndRestore.__init__ = backup_init
    _installed = True
