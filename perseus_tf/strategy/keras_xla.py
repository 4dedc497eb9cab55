"""XLA and Perseus's collectives: `compile(jit_compile=...)` on a model
whose train step holds them.

The collectives (the gradients' grouped allreduce of the Horovod shim's
DistributedOptimizer, and PerseusStrategy's reductions) have no XLA kernels,
so a train step compiled with XLA cannot contain them: TF fails the first
step with "Graph execution error", its cause ("No registered
'PerseusGroupedAllreduce' OpKernel for XLA_CPU_JIT") buried below. Keras 3's
default `jit_compile="auto"` turns XLA on by itself on a machine with a GPU
(outside a tf.distribute strategy), so an unchanged Horovod-style script
would fail there.

When Keras builds a model's train, test or predict function (after
`compile`, at the first `fit`, `evaluate` or `predict`), a model whose steps
hold Perseus collectives and that would be compiled with XLA (asked for, or
resolved from "auto") is set to `jit_compile=False` with a one-line warning,
as Keras itself does for a model with layers XLA cannot compile: its steps
still run as tf.functions. (Checked there, not in `compile`: in
`model.compile(optimizer=hvd.DistributedOptimizer(...))` the optimizer,
which installs this, is made after `compile` was looked up.)
"""

import functools

import tensorflow as tf

from perseus_tf import notices

_predicates = []   # model -> whether its train step holds Perseus collectives


def holding_collectives(holds_collectives):
    """Adds a predicate (model -> bool) of models whose steps hold Perseus
    collectives (the patch is perseus_tf.patches' xla.off_around_collectives)."""
    if holds_collectives not in _predicates:
        _predicates.append(holds_collectives)


def off_around_collectives(patching, flavour):
    """For the models holding_collectives was told of (the strategy and the
    shim register theirs before they install this)."""
    for method in ("make_train_function", "make_test_function", "make_predict_function"):
        patching.wrap("{keras}.Model." + method, _without_xla_around_collectives)


def _jit_compile(model):
    value = vars(model).get("_jit_compile")
    return value if value is not None else getattr(model, "jit_compile", False)


def _without_xla_around_collectives(make_function):
    @functools.wraps(make_function)
    def make(self, *args, **kwargs):
        if _jit_compile(self) and any(holds(self) for holds in _predicates):
            notices.warn(
                f"Perseus-TF: jit_compile={self.jit_compile!r} is turned off for model "
                f"'{self.name}': its steps hold Perseus collectives, which have no XLA "
                f"kernels; they run as tf.functions without XLA (compile(jit_compile=False) "
                f"says so and silences this)")
            self.jit_compile = False
        return make_function(self, *args, **kwargs)
    return make
