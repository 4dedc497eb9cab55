"""The world's rank and size as the Horovod API answers them: ValueError
before `init()`, as Horovod's do. Both `_basics` and `_process_sets` read
them from here (so neither imports the other's module at load time)."""

from perseus_tf import _core, ops

_NOT_INITIALIZED = "Perseus-TF (Horovod API) has not been initialized; use hvd.init()."


def _checked(query):
    if _core.state() == "uninitialized":
        raise ValueError(_NOT_INITIALIZED)
    return query()


def size():
    """Number of ranks in the job."""
    return _checked(ops.size)


def rank():
    """This process's rank, 0 .. size() - 1."""
    return _checked(ops.rank)
