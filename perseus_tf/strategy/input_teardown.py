"""Datasets distributed by PerseusStrategy start no tf.data autotuning thread.

tf.data's autotuner runs one "model" thread per iterator that sleeps between
optimizations, twice as long each time, up to 60 s. From TF 2.16 (not 2.15),
deleting such an iterator waits for that sleep to end: an iterator used for
45 s takes about 37 s to delete (measured here on TF 2.21). Keras drops an
iterator at the end of every fit, evaluate and predict, and Python's garbage
collector deletes it at a moment of its own, on one rank: that rank's main
thread then stands still for up to a minute while the others wait for it in
a collective, which GLOO_TIMEOUT_SECONDS (60 s) turns into a failed job.

So the input pipeline PerseusStrategy distributes, and each per-device
prefetch that tf.distribute's MultiDeviceIterator builds on it, run with
`options.autotune.enabled = False` (an iterator then deletes in well under a
second). A dataset whose options set `autotune.enabled = True` explicitly
keeps its autotuner. `num_parallel_calls=tf.data.AUTOTUNE` still works
without it: tf.data then uses one call per core.

TensorFlow internals reached (TF 2.15 to 2.21):
tensorflow.python.data.ops.multi_device_iterator_ops._create_device_dataset.
"""

import functools

import tensorflow as tf

def without_model_thread(dataset):
    """The dataset with tf.data's autotuner off, unless its options turn it
    on explicitly."""
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def without_autotune_threads(patching, flavour):
    """Per-device datasets of every MultiDeviceIterator made from now on
    start no autotuning thread (they are a fixed prefetch: nothing to tune)."""
    def wrap(original):
        @functools.wraps(original)
        def create_device_dataset(*args, **kwargs):
            return without_model_thread(original(*args, **kwargs))
        return create_device_dataset

    patching.wrap(
        "tensorflow.python.data.ops.multi_device_iterator_ops._create_device_dataset", wrap)
