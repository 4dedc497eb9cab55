"""Keras fit under PerseusStrategy while the last rank leaves mid-epoch:
killed (argument `kill`, the default: SIGKILL) or by `sys.exit(0)` in a
callback (`exit`: a clean exit, which shuts its runtime down).

Survivors print `REPORTED <seconds> <message>` when fit raises.
"""

import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import perseus_tf as ptf

try:
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

strategy = ptf.PerseusStrategy()
rank, size = ptf.rank(), ptf.size()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((64 * size, 4), np.float32)
y = np.ones((64 * size, 1), np.float32)
died_at = [None]
how = sys.argv[1] if len(sys.argv) > 1 else "kill"


class Die(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 5 and rank == size - 1:
            if how == "exit":
                sys.exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        if batch == 5:
            died_at[0] = time.time()


try:
    model.fit(x, y, batch_size=2 * size, epochs=1, verbose=0, callbacks=[Die()])
    print("NO ERROR", flush=True)
except Exception as e:  # noqa: BLE001 - report whatever fit raised
    print(f"REPORTED {time.time() - died_at[0]:.1f} {type(e).__name__}: {e}".replace("\n", " "),
          flush=True)
