"""`hvd.DistributedGradientTape`: a tf.GradientTape whose `gradient` returns
gradients reduced across ranks."""

import tensorflow as tf

from perseus_tf.horovod._collectives import Average
from perseus_tf.horovod._gradient_reducer import GradientReducer, resolve_groups
from perseus_tf.horovod._process_sets import global_process_set
from perseus_tf.horovod.compression import Compression


class _DistributedGradientTape(tf.GradientTape):
    """Delegates recording to the wrapped tape (public methods only) and
    reduces what `gradient` returns."""

    def __init__(self, tape, reducer):
        super().__init__()
        self._wrapped_tape = tape
        self._reducer = reducer

    def __enter__(self):
        self._wrapped_tape.__enter__()
        return self

    def __exit__(self, typ, value, traceback):
        return self._wrapped_tape.__exit__(typ, value, traceback)

    def watch(self, tensor):
        self._wrapped_tape.watch(tensor)

    def stop_recording(self):
        return self._wrapped_tape.stop_recording()

    def reset(self):
        self._wrapped_tape.reset()

    def watched_variables(self):
        return self._wrapped_tape.watched_variables()

    def jacobian(self, *args, **kwargs):
        return self._wrapped_tape.jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        return self._wrapped_tape.batch_jacobian(*args, **kwargs)

    def register_local_source(self, source):
        """Keeps `source`'s gradient local (not reduced across ranks)."""
        self._reducer.register_local_var(source)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """The wrapped tape's gradients of `target`, reduced across ranks."""
        grads = self._wrapped_tape.gradient(target, sources, output_gradients=output_gradients,
                                            unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._reducer(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """`gradient()`, split: returns (local, global), two lists of
        (source, gradient) pairs in the order of `sources`. Local pairs are
        the sources registered with `register_local_source` (their gradients
        not reduced, divided by the size when scale_local_gradients);
        global pairs have gradients reduced across ranks."""
        grads = self.gradient(target, sources, output_gradients=output_gradients,
                              use_generic_names=use_generic_names)
        local_pairs, global_pairs = [], []
        for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            is_local = self._reducer.is_local(source)
            (local_pairs if is_local else global_pairs).append((source, grad))
        return local_pairs, global_pairs


def DistributedGradientTape(gradtape, device_dense='', device_sparse='',
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wraps a tf.GradientTape so that `gradient()` combines gradients across ranks.

    Arguments are those of `hvd.DistributedOptimizer` (no local accumulation).

    Example:
      with tf.GradientTape() as tape:
          loss = loss_fn(model(x), y)
      tape = hvd.DistributedGradientTape(tape)
      grads = tape.gradient(loss, model.trainable_variables)
    """
    groups = resolve_groups(num_groups, groups)
    reducer = GradientReducer("DistributedGradientTape", device_dense, device_sparse,
                              compression, sparse_as_dense, op, gradient_predivide_factor,
                              groups, process_set, scale_local_gradients)
    return _DistributedGradientTape(gradtape, reducer)


def PartialDistributedGradientTape(gradtape, device_dense='', device_sparse='',
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that keeps the gradients of `local_layers`
    (Keras layers) local to each rank."""
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"All local layers must be Keras layers; got {layer!r}")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
