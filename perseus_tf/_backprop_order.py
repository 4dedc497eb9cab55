"""Weight gradients early: each gradient group is computed before the
backward pass goes on past it, so its allreduce can start while the earlier
layers' gradients are still being computed.

Why. Back-propagation through a layer makes two things from the gradient
that arrives at its output: the gradient of its weights (which only the
optimizer needs) and the gradient of its input (which the rest of the
backward pass needs). TF's executor is free to order them. With one
inter-op thread (a rank given one core) it runs the chain of input
gradients to the end first and queues every weight gradient behind it, so
all gradient groups become ready together at the end of the step and
communication cannot overlap back-propagation.

What. Given the gradient groups of a traced step in the order backprop
produces them (last layers first), every op that group k+1 needs but no
earlier group needs, and that reads something an earlier group needs, gets
a control input: "groups 0..k's gradients exist". The values computed do
not change, only the order. It cannot make a cycle: such an op is, by
construction, not an ancestor of any earlier group's gradient.

Only in a graph (a tf.function, Keras's train function), only when the
groups share one graph, and only for gradients (callers decide).
"""

import tensorflow as tf

# Tests and benchmarks turn it off to compare with the old order.
ENABLED = True

# Gradient groups: about this many, none smaller than _MIN_GROUP_BYTES.
_GROUPS = 4
_MIN_GROUP_BYTES = 1 << 20


def backprop_groups(indices, tensors):
    """Splits `indices` (forward order) into up to _GROUPS runs of similar
    bytes, returned last run first (the order backprop produces them)."""
    sizes = []
    for i in indices:
        n = tensors[i].shape.num_elements()
        sizes.append((n if n is not None else 0) * tensors[i].dtype.size)
    total = sum(sizes)
    target = max(_MIN_GROUP_BYTES, total // _GROUPS + 1)
    groups, current, acc = [], [], 0
    for i, b in zip(reversed(indices), reversed(sizes)):
        current.append(i)
        acc += b
        if acc >= target:
            groups.append(current[::-1])
            current, acc = [], 0
    if current:
        groups.append(current[::-1])
    return groups


def _region(ops, stop):
    """The ops that `ops` depend on (themselves included) outside `stop`."""
    region, todo = {}, list(ops)
    while todo:
        op = todo.pop()
        if op.name in stop or op.name in region:
            continue
        region[op.name] = op
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return region


def order(groups):
    """groups: lists of gradient tensors, in backprop order. Adds the control
    edges described in the module's doc; returns how many ops got one."""
    stages = staged(groups)
    return 0 if stages is None else stages.edges


class Stages:
    """What order() did to one traced step: for each stage (a group's new
    ops) its region and its frontier (the ops that got the control input),
    so that other work can hold a stage back too (gate)."""

    def __init__(self, graph):
        self.graph = graph
        self.regions = []     # stage k: {name: op} that group k needs and no earlier one
        self.frontiers = []   # stage k: the ops of regions[k] that read an earlier stage
        self.edges = 0

    def gate(self, stage, ops):
        """Holds stage `stage` of backprop (and so every later one) until
        `ops` ran, where that cannot make a cycle: no op of those stages is
        among the ancestors of `ops` (themselves included), or touches a
        resource that one of those made after it touches (automatic control
        dependencies, added once the function is traced, would join them),
        or is a stateful op that such dependencies chain in program order
        while one of those made after it is too. Returns whether it gated."""
        if stage >= len(self.frontiers) or not self.frontiers[stage] or not ops:
            return False
        if any(op.graph is not self.graph for op in ops):
            return False
        later = {}
        for region in self.regions[stage:]:
            later.update(region)
        before = _region(ops, set())
        if before.keys() & later.keys():
            return False
        # Automatic control dependencies join two ops in program order (made
        # earlier, made later): only what was made after those stages began
        # can be held back by them.
        first = min(op._id for op in later.values())  # pylint: disable=protected-access
        after = [op for op in before.values() if op._id > first]  # pylint: disable=protected-access
        if _resources(after) & _resources(later.values()):
            return False
        if _chained(after) and _chained(later.values()):
            return False
        with self.graph.as_default(), tf.name_scope("perseus_backprop_order"):
            ready = tf.group(*ops, name=f"gate_{stage}")
        for op in self.frontiers[stage]:
            op._add_control_input(ready)  # pylint: disable=protected-access
        return True


def _resources(ops):
    """Names of the resource tensors `ops` take (through Identity ops)."""
    out = set()
    for op in ops:
        for t in op.inputs:
            while t.dtype == tf.resource and t.op.type == "Identity" and t.op.inputs:
                t = t.op.inputs[0]
            if t.dtype == tf.resource:
                out.add(t.name)
    return out


def _chained(ops):
    """Whether any of `ops` is a stateful op without resource inputs that
    automatic control dependencies chain in program order."""
    try:
        from tensorflow.python.framework import auto_control_deps as acd
        unordered = acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS
    except (ImportError, AttributeError):
        unordered = frozenset()
    for op in ops:
        if (not op._is_stateful or op.type == "NoOp"  # pylint: disable=protected-access
                or op.type in unordered or "_independent_side_effects" in op.node_def.attr
                or any(t.dtype == tf.resource for t in op.inputs)):
            continue
        return True
    return False


def staged(groups):
    """order(groups), returning its Stages (None when it did nothing)."""
    if not ENABLED or tf.executing_eagerly():
        return None
    stages = [[t for t in g if isinstance(t, tf.Tensor)] for g in groups]
    if sum(1 for s in stages if s) < 2:
        return None
    graph = next(s for s in stages if s)[0].graph
    if any(t.graph is not graph for s in stages for t in s):
        return None
    out = Stages(graph)
    done = set()  # op names that groups 0..k depend on
    for k in range(len(stages)):
        region = _region([t.op for t in stages[k]], done)
        frontier = [op for op in region.values()
                    if any(t.op.name in done for t in op.inputs)
                    or any(c.name in done for c in op.control_inputs)] if k else []
        out.regions.append(region)
        out.frontiers.append(frontier)
        if frontier:
            with graph.as_default(), tf.name_scope("perseus_backprop_order"):
                ready = tf.group(*[t.op for s in stages[:k] for t in s],
                                 name=f"groups_to_{k - 1}")
            for op in frontier:
                op._add_control_input(ready)  # pylint: disable=protected-access
            out.edges += len(frontier)
        done.update(region)
    return out
