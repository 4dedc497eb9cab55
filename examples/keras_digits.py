"""Keras `fit` with PerseusStrategy on scikit-learn's digits.

Run on 2 local ranks (this is `make demo`):
    perseusrun -np 2 -- python examples/keras_digits.py

Compared with single-process Keras, the only change is the strategy: the
global batch is split across ranks, gradients are averaged across them, and
the accuracy `fit` reports is global (equal on every rank).
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf

try:
    import keras  # Keras 3 (TF >= 2.16)
except ImportError:  # pragma: no cover
    from tensorflow import keras


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the initial weights (rank 0's are broadcast)")
    args = parser.parse_args()
    keras.utils.set_random_seed(args.seed)

    strategy = perseus_tf.PerseusStrategy()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
        2000, seed=0).batch(args.global_batch)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch)

    if perseus_tf.rank() == 0:
        ranks = strategy.num_replicas_in_sync
        print(f"Training a small neural network (64 pixels -> 128 hidden units -> 10 digits) "
              f"to read handwritten digits: scikit-learn's 8x8 digit images, "
              f"{len(x_train)} for training and {len(x_test)} held out to check accuracy. "
              f"{ranks} ranks (processes) share each batch of {args.global_batch} images "
              f"({args.global_batch // ranks} each) and average their gradients through "
              f"Perseus; {args.epochs} epochs.", flush=True)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    class PrintOnRankZero(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if perseus_tf.rank() == 0:
                print(f"epoch {epoch + 1}/{args.epochs}: loss {logs['loss']:.4f} "
                      f"accuracy {logs['accuracy']:.4f} val_accuracy {logs['val_accuracy']:.4f} "
                      f"({strategy.num_replicas_in_sync} ranks)", flush=True)

    # The dataset shuffles itself; Keras warns if fit is asked to (its default).
    model.fit(train, validation_data=test, epochs=args.epochs, verbose=0, shuffle=False,
              callbacks=[PrintOnRankZero()])
    stats = perseus_tf.stats()
    if perseus_tf.rank() == 0:
        # The last stream carries online work while a plan runs offline.
        sent = sum(s["bytes"] for s in stats["streams"] + [stats["online_stream"]])
        print(f"perseus: {stats['responses']} collectives, {sent / 2**20:.2f} MiB reduced "
              f"(PERSEUS_ALLREDUCE_DTYPE={perseus_tf._native.config().allreduce_dtype}: "
              "0 = float16 gradients)", flush=True)


if __name__ == "__main__":
    main()
