"""A Horovod tf.estimator script (TF 2.15; tf.estimator was removed in TF 2.16).

    perseusrun -np 2 -- python examples/hvd_estimator.py

Each rank trains on its shard of scikit-learn's digits with a TF1-style
model_fn; BroadcastGlobalVariablesHook gives every rank rank 0's initial
(or restored) variables, DistributedOptimizer averages the gradients, and
only rank 0 keeps a model directory.
"""

import argparse
import sys
import tempfile

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import perseus_tf.horovod as hvd  # instead of: import horovod.tensorflow as hvd


def dense(x, units, name):
    with tf.compat.v1.variable_scope(name):
        w = tf.compat.v1.get_variable("kernel", [x.shape[-1], units],
                                      initializer=tf.compat.v1.glorot_uniform_initializer())
        b = tf.compat.v1.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(x, w) + b


def model_fn(features, labels, mode, params):
    logits = dense(tf.nn.relu(dense(features, 128, "hidden")), 10, "logits")
    predictions = tf.argmax(logits, 1)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions=predictions)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    if mode == tf.estimator.ModeKeys.EVAL:
        accuracy = tf.compat.v1.metrics.accuracy(labels, predictions)
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
    # Horovod: scale the learning rate by the number of ranks, wrap the optimizer.
    opt = tf.compat.v1.train.MomentumOptimizer(0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt)
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()
    if not hasattr(tf, "estimator"):
        sys.exit(f"tf.estimator was removed in TF 2.16 (this is TF {tf.__version__}); run "
                 "examples/hvd_monitored_session.py instead")

    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    y_train, y_test = y_train.astype(np.int32), y_test.astype(np.int32)

    def train_input():
        return (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shard(hvd.size(), hvd.rank()).repeat().shuffle(1000).batch(args.batch_size))

    def test_input():
        return tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(256)

    # Horovod: only rank 0 writes checkpoints.
    model_dir = tempfile.mkdtemp(prefix="hvd_estimator_") if hvd.rank() == 0 else None
    estimator = tf.estimator.Estimator(model_fn, model_dir=model_dir)
    # Horovod: broadcast rank 0's variables once the session exists (after any restore).
    estimator.train(train_input, hooks=[hvd.BroadcastGlobalVariablesHook(0)],
                    steps=args.steps // hvd.size())
    result = estimator.evaluate(test_input)
    if hvd.rank() == 0:
        print(f"test accuracy {result['accuracy']:.4f} after {result['global_step']} steps "
              f"({hvd.size()} ranks)", flush=True)


if __name__ == "__main__":
    main()
