"""A Horovod custom training loop (tf.GradientTape), run by Perseus-TF.

    perseusrun -np 2 -- python examples/hvd_tape.py

DistributedGradientTape averages the gradients over the ranks; after the
first step every rank takes rank 0's variables (Horovod's idiom).
"""

import argparse

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf.horovod as hvd  # instead of: import horovod.tensorflow as hvd

keras = tf.keras


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=hvd.rank())
               .batch(args.batch_size))

    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(0.001 * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # Horovod: wrap the tape to average gradients over the ranks.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: after the first step (which creates the optimizer's slots),
        # broadcast every variable from rank 0.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    for step, (images, labels) in enumerate(dataset.take(args.steps)):
        loss = training_step(images, labels, step == 0)
        if step % 100 == 0 and hvd.rank() == 0:
            print(f"step {step}: loss {loss.numpy():.4f}", flush=True)

    correct = np.sum(np.argmax(model(x_test).numpy(), 1) == y_test)
    accuracy = hvd.allreduce(tf.constant(correct / len(y_test), tf.float64)).numpy()
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f} ({hvd.size()} ranks)", flush=True)


if __name__ == "__main__":
    main()
