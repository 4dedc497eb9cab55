"""A Horovod TF1 script (MonitoredTrainingSession), run by Perseus-TF on any
TF version, TF 2.16+ included.

    perseusrun -np 2 -- python examples/hvd_monitored_session.py

Each rank trains on its shard of scikit-learn's digits in a TF1 graph.
"""

import argparse
import tempfile

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf.horovod as hvd  # instead of: import horovod.tensorflow as hvd

tf.compat.v1.disable_eager_execution()


def dense(x, units, name):
    with tf.compat.v1.variable_scope(name):
        w = tf.compat.v1.get_variable("kernel", [x.shape[-1], units],
                                      initializer=tf.compat.v1.glorot_uniform_initializer())
        b = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(x, w) + b


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    images = tf.compat.v1.placeholder(tf.float32, [None, 64])
    labels = tf.compat.v1.placeholder(tf.int64, [None])
    logits = dense(tf.nn.relu(dense(images, 128, "hidden")), 10, "logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))

    # Horovod: scale the learning rate by the number of ranks, wrap the optimizer.
    opt = tf.compat.v1.train.MomentumOptimizer(0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    class EvaluateAtEnd(tf.compat.v1.train.SessionRunHook):
        def end(self, session):
            self.accuracy = session.run(accuracy, {images: x_test, labels: y_test})

    evaluate = EvaluateAtEnd()
    hooks = [
        evaluate,
        # Horovod: broadcast rank 0's variables once the session exists (after any restore).
        hvd.BroadcastGlobalVariablesHook(0),
        tf.compat.v1.train.StopAtStepHook(last_step=args.steps // hvd.size()),
    ]
    # Horovod: only rank 0 writes checkpoints.
    checkpoint_dir = tempfile.mkdtemp(prefix="hvd_mts_") if hvd.rank() == 0 else None
    rng = np.random.default_rng(hvd.rank())
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                                     hooks=hooks) as sess:
        while not sess.should_stop():
            batch = rng.integers(0, len(x_train), args.batch_size)
            _, step, value = sess.run([train_op, global_step, loss],
                                      {images: x_train[batch], labels: y_train[batch]})
            if step % 50 == 0 and hvd.rank() == 0:
                print(f"step {step}: loss {value:.4f}", flush=True)
    if hvd.rank() == 0:
        print(f"test accuracy {evaluate.accuracy:.4f} ({hvd.size()} ranks)", flush=True)


if __name__ == "__main__":
    main()
