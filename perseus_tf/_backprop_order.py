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
    if not ENABLED or tf.executing_eagerly():
        return 0
    stages = [[t for t in g if isinstance(t, tf.Tensor)] for g in groups]
    stages = [s for s in stages if s]
    if len(stages) < 2:
        return 0
    graph = stages[0][0].graph
    if any(t.graph is not graph for s in stages for t in s):
        return 0
    done = set()  # op names that groups 0..k depend on
    edges = 0
    for k in range(len(stages) - 1):
        done.update(_region([t.op for t in stages[k]], done))
        later = _region([t.op for t in stages[k + 1]], done)
        frontier = [op for op in later.values()
                    if any(t.op.name in done for t in op.inputs)
                    or any(c.name in done for c in op.control_inputs)]
        if not frontier:
            continue
        with graph.as_default(), tf.name_scope("perseus_backprop_order"):
            ready = tf.group(*[t.op for s in stages[:k + 1] for t in s],
                             name=f"groups_to_{k}")
        for op in frontier:
            op._add_control_input(ready)  # pylint: disable=protected-access
        edges += len(frontier)
    return edges
