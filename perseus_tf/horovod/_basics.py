"""Start-up and topology queries of the Horovod API over the Perseus runtime.

Unlike `perseus_tf.rank()`, which starts the runtime on first use, these
raise ValueError before `init()`, as Horovod's do. After a shutdown (which a
peer that exits first also triggers) they still answer: scripts commonly
ask `hvd.rank() == 0` once training is over.
"""

import tensorflow as tf

from perseus_tf import _keras, ops
from perseus_tf.horovod._process_sets import add_process_set, process_set_by_id
from perseus_tf.horovod._world import _checked, rank, size  # noqa: F401 (API)


def init(comm=None, process_sets=None, **overrides):
    """Starts this process's runtime; collective, idempotent.

    Args:
      comm: None, or the list of every rank (Perseus-TF has no MPI and no
        sub-communicator at start-up: start ranks with `perseusrun`).
      process_sets: None, "dynamic", or a list of `ProcessSet`s to register
        (collective: every rank passes the same list).
      **overrides: PERSEUS_* settings by field name (see perseus_tf.config).
    """
    if comm is not None and not isinstance(comm, (list, tuple, range)):
        raise NotImplementedError(
            "hvd.init(comm=<MPI communicator>) is not supported: Perseus-TF does not use MPI. "
            "Start the ranks with perseusrun and call hvd.init() without comm.")
    _keras.check_supported("hvd.init()", imported_only=True)
    ops.init(**overrides)
    if comm is not None and len(comm) and sorted(comm) != list(range(ops.size())):
        raise NotImplementedError(
            f"hvd.init(comm={list(comm)}) asks for a subset of the {ops.size()} ranks; "
            "Perseus-TF always starts with every rank. Use hvd.add_process_set(ranks) "
            "for collectives among a subset.")
    if process_sets is not None and not isinstance(process_sets, str):
        for process_set in process_sets:
            add_process_set(process_set)


def shutdown():
    """Stops the runtime (collective). Later collectives fail."""
    ops.shutdown()


def is_initialized():
    return ops.is_initialized()


def local_size():
    """Number of ranks on this host."""
    return _checked(ops.local_size)


def local_rank():
    """This process's rank among the ranks of its host."""
    return _checked(ops.local_rank)


def cross_size():
    """Number of hosts that have a rank with this process's local rank."""
    return _checked(ops.cross_size)


def cross_rank():
    """Index of this process's host among those hosts."""
    return _checked(ops.cross_rank)


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    return local_size() * cross_size() == size()


def size_op(process_set_id=0, name=None):
    """`size()` (or a process set's size) as an int32 tensor."""
    return tf.constant(_set_size(process_set_id), tf.int32, name=name)


def local_size_op(name=None):
    return tf.constant(local_size(), tf.int32, name=name)


def rank_op(name=None):
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name=None):
    return tf.constant(local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    included = process_set_by_id(process_set_id).included()
    return tf.constant(1 if included else 0, tf.int32, name=name)


def _set_size(process_set_id):
    if process_set_id == 0:
        return size()
    return process_set_by_id(process_set_id).size()


# What this build has. Perseus-TF runs its collectives over Gloo (TCP); it
# has no MPI, NCCL, DDL, oneCCL or ROCm path today.

def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (False while a tf.function is
    traced). Private in Horovod too, but Horovod's own tests call it."""
    return tf.executing_eagerly()


def mpi_threads_supported():
    """Raises ValueError, as Horovod does when MPI is not enabled."""
    raise ValueError("MPI is not enabled: Perseus-TF runs its collectives over Gloo, so "
                     "there is no MPI thread support to query.")


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return True


def gloo_built():
    return True


def nccl_built():
    """NCCL's version code (22304 for 2.23.4) when this process can load
    NCCL, else 0, as Horovod returns for a build with or without it.
    Perseus-TF loads NCCL at run time (PERSEUS_NCCL_LIBRARY, else the
    nvidia-nccl wheels that tensorflow[and-cuda] installs, else the loader's
    path), so this says whether GPU tensors can go through NCCL here."""
    from perseus_tf import _native
    info = _native.nccl_library()
    return int(info["version"]) if info.get("available") else 0


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """Whether this install holds the CUDA data plane (libperseus_cuda.so,
    which every install builds with the host compiler): GPU tensors are then
    reduced on their GPU wherever the NVIDIA driver and NVRTC are found
    (`python -m perseus_tf.gpu` says whether they are)."""
    from perseus_tf import gpu
    return gpu.cuda_library() is not None


def rocm_built():
    return False


def start_timeline(file_path, mark_cycles=False):
    """Starts recording this rank's timeline (a Chrome trace) into a file
    derived from `file_path`: trace.json becomes trace.rank<R>.json ("{rank}"
    in the name is replaced instead). With mark_cycles, each negotiation cycle
    is recorded too (a "negotiate" span on the negotiation thread)."""
    from perseus_tf import _native

    _native.ensure_initialized()
    _native._core.start_timeline(_native.timeline_path(str(file_path), rank()),
                                 mark_cycles=bool(mark_cycles))


def stop_timeline():
    """Writes the timeline started by start_timeline (or PERSEUS_TIMELINE) and stops it."""
    from perseus_tf import _native

    _native._core.stop_timeline()
