"""Data-parallel training of a small Keras model on scikit-learn's digits.

Run on 2 local ranks:
    perseusrun -np 2 -- python examples/keras_digits.py

Each rank trains on its own shard of the training set. Gradients are
averaged across ranks with one grouped (fused) allreduce per step; initial
weights come from rank 0; accuracy is counted on every rank's shard of the
test set and summed, so the figure rank 0 prints is global.
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf as ptf


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    ptf.init()
    rank, size = ptf.rank(), ptf.size()
    tf.random.set_seed(1234 + rank)  # ranks start different; the broadcast aligns them

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    per_rank = args.global_batch // size
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shard(size, rank).shuffle(2000, seed=rank).batch(per_rank, drop_remainder=True))
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).shard(size, rank).batch(256)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    optimizer = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    for v in model.trainable_variables:
        v.assign(ptf.broadcast(v, root_rank=0, name="init." + v.name))

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = ptf.grouped_allreduce(grads, op=ptf.Average, name="grads")
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return ptf.allreduce(loss, op=ptf.Average, name="loss")

    @tf.function
    def correct(xb, yb):
        pred = tf.argmax(model(xb, training=False), axis=1, output_type=tf.int64)
        return tf.reduce_sum(tf.cast(tf.equal(pred, yb), tf.int64))

    for epoch in range(args.epochs):
        losses = [train_step(xb, yb).numpy() for xb, yb in train]
        hits = sum(int(correct(xb, yb)) for xb, yb in test)
        counts = ptf.allreduce(tf.constant([hits, 0], tf.int64) + [0, len(list(test.unbatch()))],
                               op=ptf.Sum, name="eval").numpy()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.4f} "
                  f"test accuracy {counts[0] / counts[1]:.4f} "
                  f"({counts[0]}/{counts[1]}, {size} ranks)", flush=True)


if __name__ == "__main__":
    main()
