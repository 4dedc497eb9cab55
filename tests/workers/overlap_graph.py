"""What the overlap checks of every user path share (checks_strategy,
checks_horovod, checks_horovod_keras).

Overlap means: inside a traced step, the gradient groups' allreduces are ops
that TF may start as soon as their own gradients exist. So in the graph of
the step (not inside a cond branch, where every input waits for the cond):
- there are several PerseusGroupedAllreduce ops of gradients;
- the group holding the last layer's gradient does not depend, through data
  or control edges, on the first layer's gradient;
- no group depends on another group;
- the first layer's gradient waits for the last layer's (through the control
  edges of perseus_tf._backprop_order): weight gradients are computed as
  backprop reaches them, not all at its end.

`chained()` puts TF's automatic control dependencies back between groups (as
on a TF without the order-insensitive set) and leaves weight gradients in
TF's own order: the non-overlapped path, whose results the overlapped path
must reproduce.
"""

import contextlib

from tensorflow.python.framework import auto_control_deps as acd

from perseus_tf import _backprop_order
from perseus_tf import ops as perseus_ops

OP = "PerseusGroupedAllreduce"


@contextlib.contextmanager
def recording_graphs():
    """Yields a list that collects the graph of every grouped allreduce built
    meanwhile (any tf.function, Keras train function or cond branch)."""
    graphs = []
    original = perseus_ops.grouped_allreduce

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        graph = out[0].graph if out and hasattr(out[0], "graph") else None
        if graph is not None and all(graph is not g for g in graphs):
            graphs.append(graph)
        return out

    perseus_ops.grouped_allreduce = recording
    try:
        yield graphs
    finally:
        perseus_ops.grouped_allreduce = original


@contextlib.contextmanager
def chained():
    """Traces made inside run the groups in program order, one after another."""
    before = acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS
    acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = before - frozenset([OP])
    _backprop_order.ENABLED = False
    try:
        yield
    finally:
        acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = before
        _backprop_order.ENABLED = True


def _ancestors(op):
    seen, todo = set(), [t.op for t in op.inputs] + list(op.control_inputs)
    while todo:
        o = todo.pop()
        if o.name not in seen:
            seen.add(o.name)
            todo.extend([t.op for t in o.inputs] + list(o.control_inputs))
    return seen


def _groups(graphs):
    # Gradient groups only (marked plannable): a step's other reductions,
    # such as every rank's "is there a batch" vote before the forward pass,
    # may come first.
    found = [(g, [op for op in g.get_operations()
                  if op.type == OP and op.get_attr("plannable")]) for g in graphs]
    found = [(g, groups) for g, groups in found if groups]
    assert found, "no grouped allreduce was traced"
    return found


def overlaps(graphs, first_shape, last_shape):
    """True when the traced step lets groups run during backprop (see the
    module's doc); False when they are chained. Raises AssertionError when
    the step was not traced as expected (too few groups, groups in a branch)."""
    graph, groups = max(_groups(graphs), key=lambda item: len(item[1]))
    assert len(groups) >= 2, [op.name for op in groups]

    def group_of(shape):
        return next(op for op in groups if any(t.shape.as_list() == shape for t in op.inputs))

    first, last = group_of(first_shape), group_of(last_shape)
    assert first is not last, first.name
    producers = [t.op for t in first.inputs if t.shape.as_list() == first_shape]
    # Inside a cond branch the gradient would arrive as a placeholder: the
    # whole branch, all groups included, would wait for every gradient.
    assert all(p.type != "Placeholder" for p in producers), (
        f"{first.name} reduces a gradient computed outside its graph "
        f"({[p.type for p in producers]}): the groups sit in a branch that waits for "
        f"all gradients")
    independent = not {p.name for p in producers} & _ancestors(last)
    unchained = not any(op.name in _ancestors(other) for op in groups for other in groups)
    last_producers = {t.op.name for t in last.inputs if t.shape.as_list() == last_shape}
    early = last_producers <= _ancestors(producers[0]) | {producers[0].name}
    return independent and unchained and early
