"""Variable and Python-object broadcasts of the Horovod API.

Objects travel pickled (cloudpickle when installed) as uint8 tensors: first
their byte counts, then the bytes.
"""

import io

import numpy as np
import tensorflow as tf

from perseus_tf.horovod import _basics
from perseus_tf.horovod._collectives import allgather, broadcast
from perseus_tf.horovod._process_sets import global_process_set

try:
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover - cloudpickle is optional
    import pickle as _pickle


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns `root_rank`'s values to `variables` on every rank.

    Eagerly this runs now; in a graph it returns the op that does it.
    `inplace` is accepted for compatibility (assignment is always used).
    """
    variables = list(variables)
    if tf.executing_eagerly():
        for var in variables:
            var.assign(broadcast(tf.convert_to_tensor(var), root_rank, process_set=process_set))
        return None
    return tf.group(*[var.assign(broadcast(tf.convert_to_tensor(var), root_rank,
                                           process_set=process_set))
                      for var in variables])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Horovod's in-place broadcast: assigns `root_rank`'s values to
    `variables` (one variable or a list) on every rank of `process_set`, and
    returns their new values (one tensor, or a list in the same order).
    Eagerly and in `tf.function`; in a TF1 graph the returned tensors carry
    the assignment."""
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    for i, var in enumerate(variables):
        if not hasattr(var, "assign") or not hasattr(var, "read_value"):
            raise TypeError(f"hvd.broadcast_ assigns to variables; item {i} is a "
                            f"{type(var).__name__} (use hvd.broadcast for tensors)")
    values = []
    for i, var in enumerate(variables):
        value = broadcast(tf.convert_to_tensor(var), root_rank,
                          name=None if name is None else f"{name}.{i}", process_set=process_set)
        with tf.control_dependencies([var.assign(value, read_value=False)]):
            values.append(var.read_value())
    return values[0] if single else values


def broadcast_global_variables(root_rank):
    """The op that broadcasts every global variable of the default graph (TF1 graphs).

    Eagerly, use `hvd.broadcast_variables(model.variables, root_rank)` instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` "
                           "instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _to_numpy(value, session):
    if tf.executing_eagerly():
        return value.numpy()
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        raise ValueError("in graph mode, pass session= (or run inside `with session.as_default()`)")
    return session.run(value)


def _dumps(obj):
    buffer = io.BytesIO()
    _pickle.dump(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Returns `root_rank`'s `obj` (any picklable object) on every rank.

    Args:
      obj: the object (only root_rank's is used).
      root_rank: the rank whose object is sent.
      session: in graph mode, the session that runs the transfer.
      name: pairs the call across ranks (default: the object's type name).
    """
    name = name or type(obj).__name__
    if _basics.rank() == root_rank:
        payload = _dumps(obj)
        count = np.array([payload.size], np.int64)
    else:
        payload, count = None, np.array([0], np.int64)
    count = _to_numpy(broadcast(tf.constant(count), root_rank, name=name + ".sz",
                                process_set=process_set), session)
    if payload is None:
        payload = np.zeros(int(count[0]), np.uint8)
    received = _to_numpy(broadcast(tf.constant(payload), root_rank, name=name + ".t",
                                   process_set=process_set), session)
    if _basics.rank() == root_rank:
        return obj
    return _pickle.loads(received.tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function `fn(obj)` that broadcasts objects with these settings."""
    def _fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return _fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Returns the list of every rank's `obj` (any picklable object), in rank order."""
    name = name or type(obj).__name__
    payload = _dumps(obj)
    counts = _to_numpy(allgather(tf.constant([payload.size], tf.int64), name=name + ".sz",
                                 process_set=process_set), session)
    gathered = _to_numpy(allgather(tf.constant(payload), name=name + ".t",
                                   process_set=process_set), session)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [_pickle.loads(gathered[offsets[i]:offsets[i + 1]].tobytes())
            for i in range(len(counts))]
