"""ModelCheckpoint into a directory that fills up (a small tmpfs), under
PerseusStrategy: rank 0 writes the checkpoints and gets ENOSPC; the others
print REPORTED <seconds> <message> for the error they got.

Usage: full_disk_worker.py DIRECTORY. (With TMPDIR on the small disk and
DIRECTORY elsewhere, the ranks other than 0 fill their scratch copies.)
"""

import os
import sys
import time

import numpy as np
import tensorflow as tf

import perseus_tf

try:
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

strategy = perseus_tf.PerseusStrategy()
rank = perseus_tf.rank()
x = np.random.default_rng(0).normal(size=(64, 256)).astype("float32")
y = x[:, :1] * 2
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
name = "m{epoch}.keras" if keras.__version__.startswith("3.") else "m{epoch}.h5"
checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(sys.argv[1], name))
if rank != 0:
    started = time.monotonic()
    try:
        model.fit(data, epochs=50, verbose=0, callbacks=[checkpoint])
    except Exception as e:  # pylint: disable=broad-except
        print(f"REPORTED {time.monotonic() - started:.2f} {str(e).splitlines()[0]}", flush=True)
        raise
else:
    model.fit(data, epochs=50, verbose=0, callbacks=[checkpoint])
