"""`hvd.BroadcastGlobalVariablesHook` for tf.estimator (TF 2.15) and
tf.compat.v1.train.MonitoredTrainingSession (every TF version).

Horovod 0.28 looks for the hook base class under `tf.estimator` or
`tf.train`, neither of which has it on TF >= 2.16, and silently defines no
hook; `tf.compat.v1.train.SessionRunHook` (the class Estimator's hooks are
checked against) exists on every supported version.
"""

import contextlib

import tensorflow as tf

from perseus_tf.horovod.functions import broadcast_global_variables


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts every global variable from `root_rank` once the session exists.

    The broadcast runs in `after_create_session`, i.e. after variables were
    initialised or restored from a checkpoint, so every rank starts from the
    root's (possibly restored) values.

    Args:
      root_rank: the rank whose values every rank takes.
      device: device for the broadcast ops ('' = default).

    Example:
      hooks = [hvd.BroadcastGlobalVariablesHook(0)]
      with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess: ...
    """

    def __init__(self, root_rank, device=''):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device) if self.device else contextlib.nullcontext():
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
