"""A Horovod Keras script, run by Perseus-TF: only the import line differs.

    perseusrun -np 2 -- python examples/hvd_keras_digits.py

Each rank trains on its shard of scikit-learn's digits; DistributedOptimizer
averages the gradients, the callbacks broadcast rank 0's initial state,
average the metrics over ranks and warm the learning rate up.
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf.horovod.keras as hvd  # instead of: import horovod.tensorflow.keras as hvd

keras = tf.keras


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    # Horovod: each rank reads its own shard.
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test, y_test = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    # Horovod: scale the learning rate by the number of ranks, wrap the optimizer.
    lr = 0.025 * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    class PrintOnRankZero(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if hvd.rank() == 0:
                print(f"epoch {epoch + 1}/{args.epochs}: loss {logs['loss']:.4f} "
                      f"accuracy {logs['accuracy']:.4f} val_accuracy {logs['val_accuracy']:.4f} "
                      f"lr {logs['lr']:.4f} ({hvd.size()} ranks)", flush=True)

    callbacks = [
        # Horovod: start every rank from rank 0's weights.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: report metrics averaged over the ranks (before callbacks that read them).
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: ramp the learning rate up from lr / size over the first epochs.
        # (Keras 3 compiles momentum in as a constant, so no momentum correction.)
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2,
                                                 momentum_correction=False),
        PrintOnRankZero(),
    ]
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_test, y_test), callbacks=callbacks, verbose=0)


if __name__ == "__main__":
    main()
