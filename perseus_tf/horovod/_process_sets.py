"""Process sets: collectives among a subset of the ranks (AIACC's "GroupComm").

A `ProcessSet` names ranks; `add_process_set` registers it with the runtime
(a collective call on every rank, members or not) and gives it an id that
collectives take as `process_set=`. The global set (id 0) is every rank.
The registration itself is native: `perseus_tf.ops.add_process_set`.
"""

from perseus_tf import ops
from perseus_tf.horovod import _world

_registered = {}  # id -> ProcessSet


class ProcessSet:
    """A set of ranks that run collectives together.

    Args:
      ranks: the global ranks of the members (any order; kept sorted).

    Example:
      evens = hvd.add_process_set([0, 2])
      hvd.allreduce(t, process_set=evens)   # on ranks 0 and 2 only
    """

    def __init__(self, ranks):
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ValueError("ProcessSet takes a list of rank numbers (mpi4py communicators "
                             "are not supported: Perseus-TF does not use MPI)") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self._ranks = ranks
        self.process_set_id = None
        self.mpi_comm = None

    @property
    def ranks(self):
        return self._ranks

    @ranks.setter
    def ranks(self, value):
        self._ranks = value

    def size(self):
        """Number of members, or None while the set is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self):
        """This process's index among the members, or None while not registered.

        Raises ValueError on a process that is not a member.
        """
        if self.process_set_id is None:
            return None
        me = _world.rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not part of {self}")
        return self.ranks.index(me)

    def included(self):
        """Whether this process is a member, or None while not registered."""
        if self.process_set_id is None:
            return None
        return _world.rank() in self.ranks

    def invalidate(self):
        self.process_set_id = None

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank; id 0; needs no registration."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        try:
            return list(range(_world.size()))
        except ValueError:  # before init
            return []

    @ranks.setter
    def ranks(self, value):
        pass

    def size(self):
        return _world.size()

    def rank(self):
        return _world.rank()

    def included(self):
        return True

    def invalidate(self):
        pass  # the global set is never removed


global_process_set = _GlobalProcessSet()
_registered[0] = global_process_set


def add_process_set(process_set):
    """Registers a process set (a `ProcessSet` or a list of ranks) on every rank.

    Collective: every rank, member or not, calls it with the same ranks, in the
    same order as other add/remove calls. Returns the registered `ProcessSet`.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    n = _world.size()
    bad = [r for r in process_set.ranks if not 0 <= r < n]
    if not process_set.ranks or bad:
        raise ValueError(f"process set ranks must be a non-empty subset of 0..{n - 1}, "
                         f"got {process_set.ranks}")
    process_set.process_set_id = int(ops.add_process_set(list(process_set.ranks)))
    _registered[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregisters a process set on every rank (collective); returns whether it was.

    The global process set is never removed (returns False).
    """
    if process_set.process_set_id in (None, 0):
        return False
    set_id = process_set.process_set_id
    ops.remove_process_set(set_id)
    _registered.pop(set_id, None)
    process_set.invalidate()
    return True


def process_set_by_id(process_set_id):
    if process_set_id not in _registered:
        raise ValueError(f"no registered process set has id {process_set_id}")
    return _registered[process_set_id]


def op_kwargs(process_set):
    """Keyword arguments selecting `process_set` for a perseus_tf.ops collective."""
    if process_set is None or process_set.process_set_id == 0:
        return {}
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: call hvd.add_process_set first")
    return {"process_set_id": process_set.process_set_id}
