"""PerseusStrategy: a tf.distribute strategy whose replicas are processes.

It is a MirroredStrategy (Keras 2 and 3 accept it where they accept
MirroredStrategy) made global: the replica count is the world size, datasets
are sharded per rank, variables start from rank 0's values, and every
reduction goes through PerseusCrossDeviceOps across processes.

The package also holds the code of the Keras patches the strategy installs
(perseus_tf/patches.py lists them, with the Keras releases each applies to,
and installs them in order): keras_backports (what Keras
3.8 does under a strategy, on 3.0 to 3.7: averaged gradients, global
metrics), keras_mixed (mixed-precision step skipping agreed by all ranks), keras_xla
(no XLA around the collectives),
keras_files (one writer for checkpoints and backups, restore checks, step
resume), keras_preempt (a SIGTERM stops every rank after the same batch with
a backup, for a restart at the next size) and keras_save (saving on one rank: averaged statistics at epoch
ends, local reads while saving). They take what they need to know of the strategy as arguments and
never import this module.

Example (started with `perseusrun -np 4 -- python train.py`):
    strategy = perseus_tf.PerseusStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset, epochs=3)
"""

import itertools
import threading

import numpy as np

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.util import nest

from perseus_tf import _keras
from perseus_tf import _malloc
from perseus_tf import _native
from perseus_tf import config
from perseus_tf import gpu
from perseus_tf import ops as perseus_ops
from perseus_tf import patches
from perseus_tf.cross_device_ops import PerseusCrossDeviceOps
from perseus_tf.strategy import input_teardown, keras_backports, keras_save, keras_shard, keras_xla

_BROADCASTABLE = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64,
                  tf.uint8, tf.int8, tf.uint16, tf.int16, tf.bool}


_METRIC_AGGREGATION = {"sum": tf.VariableAggregation.SUM, "mean": tf.VariableAggregation.MEAN}

# Set while a Keras 3 BatchNormalization creates its moving statistics.
_batch_norm_statistics = threading.local()


def mark_batch_norm_statistics(patching, flavour):
    """Marks Keras 3 BatchNormalization's moving statistics as they are
    created (see PerseusExtended._create_variable); Keras 2 already creates
    them ON_READ with MEAN."""
    _, _, original = patching.target("{keras}.layers.BatchNormalization.build")

    def build(self, input_shape):
        add_weight = self.add_weight

        def marked(*args, **kwargs):
            moving = not kwargs.get("trainable", True) and \
                str(kwargs.get("name", "")).startswith("moving_")
            _batch_norm_statistics.on = moving
            try:
                return add_weight(*args, **kwargs)
            finally:
                _batch_norm_statistics.on = False

        object.__setattr__(self, "add_weight", marked)
        try:
            return original(self, input_shape)
        finally:
            object.__delattr__(self, "add_weight")

    patching.wrap("{keras}.layers.BatchNormalization.build", lambda _: build)


class PerseusExtended(mirrored_strategy.MirroredExtended):
    """MirroredExtended whose sync group spans every rank's local devices."""

    def __init__(self, container_strategy, devices=None, cross_device_ops=None):
        super().__init__(container_strategy, devices=devices or ["/cpu:0"],
                         cross_device_ops=cross_device_ops or PerseusCrossDeviceOps())
        self._rank = perseus_ops.rank()
        self._size = perseus_ops.size()
        self._var_counter = itertools.count()
        # What Keras' file-writing callbacks ask of a multi-worker strategy.
        self._task_type = "worker"
        self._task_id = self._rank

    # -- global replica numbering ------------------------------------------------

    @property
    def _num_replicas_in_sync(self):
        return len(self._devices) * self._size

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self._rank * len(self._devices)

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._rank * len(self._devices) + replica_id

    def _in_multi_worker_mode(self):
        return self._size > 1

    @property
    def should_checkpoint(self):
        return self._rank == 0

    @property
    def should_save_summary(self):
        return self._rank == 0

    # -- input ---------------------------------------------------------------------

    def _make_input_context(self):
        return distribute_lib.InputContext(num_input_pipelines=self._size,
                                           input_pipeline_id=self._rank,
                                           num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        if (options and options.experimental_replication_mode ==
                distribute_lib.InputReplicationMode.PER_REPLICA):
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "distribute_datasets_from_function")
        return input_util.get_distributed_dataset(
            input_teardown.without_model_thread(dataset),
            self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync,
            input_context=self._make_input_context(), options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        def without_model_thread(context):
            return input_teardown.without_model_thread(dataset_fn(context))

        return input_util.get_distributed_datasets_from_function(
            without_model_thread, self._input_workers_with_options(options),
            [self._make_input_context()], self._container_strategy(), options)

    def _experimental_distribute_values_from_function(self, value_fn):
        values = []
        for local_id in range(len(self._devices)):
            replica_id = self._get_replica_id_in_sync_group(local_id)
            values.append(value_fn(distribute_lib.ValueContext(replica_id,
                                                               self._num_replicas_in_sync)))
        return distribute_utils.regroup(values, always_wrap=True)

    # -- variables -----------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        # Batch-norm moving statistics: Keras 2 creates them ON_READ with
        # MEAN aggregation (each rank updates its own copy, reading outside a
        # replica, as saving does, averages them over the ranks). Keras 3
        # asks for "auto" with no aggregation, so every rank would keep and
        # save its own. PerseusStrategy makes Keras 3's (marked by
        # _batch_norm_statistics below) behave as Keras 2's: no communication
        # during training, one average whenever they are read to be saved.
        if getattr(_batch_norm_statistics, "on", False):
            kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
            kwargs["aggregation"] = tf.VariableAggregation.MEAN
        # Keras 3.0 to 3.9's metric variables, as 3.10 makes them (keras_backports).
        aggregation = _METRIC_AGGREGATION.get(keras_backports.metric_variable())
        if aggregation is not None:
            kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
            kwargs["aggregation"] = aggregation
        return super()._create_variable(next_creator, **kwargs)

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if replica_id != 0 or keras_shard.creating_slots():
            if replica_id == 0:
                next(self._var_counter)  # a sharded slot: ranks differ in its shape
            return super()._get_variable_creator_initial_value(replica_id, device, primary_var,
                                                               **kwargs)
        # Every rank creates its variables in the same order: the counter
        # pairs each variable's broadcast across ranks.
        name = "perseus.var_init.%d" % next(self._var_counter)
        size = self._size

        def initial_value_fn():
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                if isinstance(value, trackable_base.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype", None))
                if size > 1 and value.dtype in _BROADCASTABLE:
                    value = perseus_ops.broadcast(value, root_rank=0, name=name)
                return value

        return initial_value_fn

    # -- reductions ----------------------------------------------------------------

    def _get_cross_device_ops(self, value):
        # MirroredExtended sends int32 to a local-only reduction; every dtype
        # must cross processes here.
        return self._cross_device_ops

    def _reduce_to(self, reduce_op, value, destinations, options):
        if distribute_utils.is_mirrored(value) and reduce_op == reduce_util.ReduceOp.MEAN:
            return value
        if keras_save.local_reads_active() and isinstance(value, values_lib.SyncOnReadVariable):
            # Keras is saving: this rank's own copy, no collective (the save
            # may run on this rank alone; keras_save.py says why it is right).
            return value.values[0].read_value()

        def reduce_one(v):
            if not isinstance(v, values_lib.DistributedValues) and self._size == 1:
                # The same value on every replica (or 0).
                return cross_device_ops_lib.reduce_non_distributed_value(
                    reduce_op, v, destinations, self._num_replicas_in_sync)
            # With several ranks a plain tensor is this rank's contribution
            # (e.g. tf.data's int64 "has data" flag for uneven last batches).
            # No local shortcut for CPU destinations: the value lives on
            # every rank and must be reduced across them.
            return self._cross_device_ops.reduce(reduce_op, v, destinations=destinations,
                                                 options=options)

        return nest.map_structure(reduce_one, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self._cross_device_ops.batch_reduce(reduce_op, value_destination_pairs,
                                                   options=options)

    def _gather_to_implementation(self, value, destinations, axis, options):
        if not isinstance(value, values_lib.DistributedValues):
            value = values_lib.PerReplica([value])
        return self._cross_device_ops._gather(value, destinations=destinations, axis=axis,
                                              options=options)


def _cluster_resolver(placement):
    """What MultiWorkerMirroredStrategy users read from
    `strategy.cluster_resolver`: task_type "worker", task_id the rank, and a
    cluster spec whose "worker" job lists every rank's host address (in rank
    order; no TF server runs, so the entries carry no port). Built at
    construction, when every rank is here: the addresses are one allgather,
    which also carries each rank's GPU for the one-rank-per-GPU check."""
    width = 64
    mine = (_native.host_addr().encode()[:width].ljust(width, b"\0") +
            placement.identity.encode()[:width].ljust(width, b"\0"))
    if perseus_ops.size() > 1:
        with tf.device("/cpu:0"):
            rows = perseus_ops.allgather(
                tf.constant(np.frombuffer(mine, np.uint8)[None, :]),
                name="perseus.strategy.host_addresses").numpy()
    else:
        rows = np.frombuffer(mine, np.uint8)[None, :]
    workers = [bytes(row[:width]).rstrip(b"\0").decode() for row in rows]
    gpus = [bytes(row[width:]).rstrip(b"\0").decode() for row in rows]
    gpu.check_one_rank_per_gpu(workers, gpus, getattr(_native.config(), "gpu_transport", "host"))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": workers}), task_type="worker",
        task_id=perseus_ops.rank(), num_accelerators={}, rpc_layer="")


def _trains_under_perseus(model):
    """Whether a compiled model trains under a PerseusStrategy (its
    reductions are Perseus collectives)."""
    return isinstance(getattr(model, "distribute_strategy", None), PerseusStrategy)


class PerseusStrategy(tf.distribute.MirroredStrategy):
    """Data parallelism across processes, one replica per process.

    The processes are started by perseusrun, mpirun, Slurm's srun, torchrun
    (or anything that sets its variables) or a TF_CONFIG scheduler; see
    perseus_tf.config for how each finds its rank.

    Args:
      devices: local devices this process drives (default: its local
        rank's GPU on a machine with GPUs, pinned as perseus_tf.gpu.pin()
        says, else its CPU); the chosen placement is `strategy.placement`.
      cross_device_ops: defaults to PerseusCrossDeviceOps().
      cluster_resolver: a tf.distribute.cluster_resolver ClusterResolver
        (TFConfigClusterResolver, SlurmClusterResolver, SimpleClusterResolver),
        as MultiWorkerMirroredStrategy takes: the process's rank and the world
        come from its cluster_spec(), task_type and task_id (the chief first,
        then the workers), instead of the environment; rank 0 serves the
        rendezvous store at the first address (see perseus_tf.config). It is
        then `strategy.cluster_resolver`. The runtime must not already run
        as another rank.
      **options: runtime options by field name (see perseus_tf.config.Config,
        e.g. streams=2, timeout_seconds=30); they override PERSEUS_* variables
        and take effect when this is the first thing to start the runtime.
        Unknown names raise perseus_tf.config.ConfigError.
    """

    _collective_key_base = 0

    def __init__(self, devices=None, cross_device_ops=None, cluster_resolver=None,
                 **options):
        # A Keras outside the supported range: one line, before anything starts.
        _keras.check_supported("PerseusStrategy()")
        # Read once: rejects unknown or invalid options even when the runtime
        # is already running, and gives this instance's accumulation setting
        # (the environment's, or the accumulate_n_steps option).
        cfg = config.load_config(options)
        cluster = None if cluster_resolver is None else \
            config.cluster_from_resolver(cluster_resolver)
        _native.init(cluster=cluster, **options)
        # On a GPU machine each rank trains on its local rank's GPU alone
        # (before TF starts its GPUs: the extended strategy below would).
        placement = gpu.Placement("/cpu:0") if devices is not None else \
            gpu.pin(memory_growth=bool(cfg.gpu_memory_growth))
        extended = PerseusExtended(self, devices=devices or [placement.device],
                                   cross_device_ops=cross_device_ops)
        self.placement = placement
        tf.distribute.Strategy.__init__(self, extended)
        self._accumulate_n_steps = cfg.accumulate_n_steps
        self._shard_optimizer_state = bool(cfg.shard_optimizer_state)
        self._preemption_check_seconds = cfg.preemption_check_seconds
        # Before any dataset is distributed: TF 2.21's input iterator would
        # otherwise leave every large malloc of the step an mmap (_malloc).
        _malloc.restore(cfg.malloc_mmap_threshold)
        if self._accumulate_n_steps > 1 and len(extended._devices) > 1:
            raise ValueError(
                f"accumulate_n_steps={self._accumulate_n_steps} (PERSEUS_ACCUMULATE_N_STEPS) "
                f"needs one device per process; this strategy drives {len(extended._devices)} "
                "(use devices=None, or accumulate_n_steps=1)")
        # The host allgather runs on every rank alike, resolver or not.
        extended._cluster_resolver = _cluster_resolver(placement)
        if cluster_resolver is not None:
            extended._cluster_resolver = cluster_resolver
        install_patches()


def install_patches():
    """Every patch of Keras and TF internals PerseusStrategy needs, in
    perseus_tf.patches' order (those applied already stay as they are)."""
    keras_xla.holding_collectives(_trains_under_perseus)
    keras_backports.also_under(_is_perseus)
    names = patches.STRATEGY + (patches.STRATEGY_MULTI_RANK if perseus_ops.size() > 1 else ())
    patches.install(names, is_perseus=_is_perseus, allreduce_average=_average_on_read,
                    rank=perseus_ops.rank())


def _is_perseus(strategy):
    return isinstance(strategy, PerseusStrategy)


def _average_on_read(tensors):
    return perseus_ops.grouped_allreduce(tensors, op=perseus_ops.Average,
                                         name="perseus.average_on_read_variables")
