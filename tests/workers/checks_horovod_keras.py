"""The Horovod Keras API (`perseus_tf.horovod.keras`) on every rank: Keras 3
on TF 2.21, Keras 2 on TF 2.15.

Run by tests/test_horovod.py through harness.run_checks at 2 and 4 ranks.
Distributed training is compared with single-process training of the same
model on the same global batches, computed on each rank.
"""

import os
import tempfile
import warnings

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
import perseus_tf.horovod as hvd_tf
import perseus_tf.horovod.keras as hvd
from perseus_tf.horovod.keras._optimizer import is_distributed

import overlap_graph
from checks_horovod import counting_native_calls, teardown  # noqa: F401
from rank_checks import expect, same_on_all_ranks

keras = tf.keras
# The checks that run at 4 ranks too (tests/test_horovod.py; every check runs
# at 2): the warm-up's size factor (N - 1) / 2 equals 1 / N at 2 ranks, so a
# wrong one passes there.
AT_4_RANKS = ("check_learning_rate_warmup_callback",)

R = N = None
rng = np.random.default_rng(0)
X = rng.normal(size=(96, 6)).astype(np.float32)
Y = (X @ rng.normal(size=(6, 1)) + 0.1).astype(np.float32)
GLOBAL_BATCH = 16


def setup():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    return R


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def my_shard(x, batch):
    """Rank R's rows of each global batch of batch * N rows, in order."""
    parts = [x[t + R * batch:t + (R + 1) * batch] for t in range(0, len(x), batch * N)]
    return np.concatenate(parts)


def weights(model):
    return [w.numpy() for w in model.weights]


def check_fit_matches_single_process_training():
    b = GLOBAL_BATCH // N
    model = make_model(seed=R)  # different initial weights on every rank
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    with counting_native_calls() as calls:
        model.fit(my_shard(X, b), my_shard(Y, b), batch_size=b, epochs=2, shuffle=False,
                  callbacks=callbacks, verbose=0)
    # Gradients went through the fused grouped request, not per-tensor allreduces.
    assert calls["single"] == 0 and any(tf.float32 in c for c in calls["grouped"]), calls
    same_on_all_ranks(weights(model))  # exactly equal
    ref = make_model(seed=0)  # rank 0's initial weights
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for a, r in zip(weights(model), weights(ref)):
        np.testing.assert_allclose(a, r, atol=1e-5)


def check_backward_passes_equal_a_k_times_larger_batch():
    k, b, steps = 2, 4, 3
    big = k * N * b
    x, y = X[:steps * big], Y[:steps * big]
    mine_x = np.concatenate([x[t * big + (j * N + R) * b:][:b] for t in range(steps)
                             for j in range(k)])
    mine_y = np.concatenate([y[t * big + (j * N + R) * b:][:b] for t in range(steps)
                             for j in range(k)])
    model = make_model(seed=3)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=k,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(mine_x, mine_y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    ref = make_model(seed=3)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(x, y, batch_size=big, epochs=1, shuffle=False, verbose=0)
    for a, r in zip(weights(model), weights(ref)):
        np.testing.assert_allclose(a, r, atol=1e-5)
    assert int(opt.iterations.numpy()) == k * steps  # skipped passes still count
    same_on_all_ranks(weights(model))


def check_custom_loop_apply_gradients_in_tf_function():
    w = tf.Variable(np.ones((3,), np.float32))
    opt = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(1.0))  # the TF module dispatches
    assert is_distributed(opt) and isinstance(opt, keras.optimizers.SGD)
    x = tf.constant(np.full((3,), R + 1, np.float32))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    step()
    step()
    mean_grad = np.mean([r + 1 for r in range(N)])
    np.testing.assert_allclose(w.numpy(), 1.0 - 2 * mean_grad, rtol=1e-6)
    expect(ValueError, lambda: hvd.DistributedOptimizer(opt), "already")
    expect(ValueError, lambda: hvd.DistributedOptimizer(object()), "Keras optimizer")


WIDE_X = rng.normal(size=(64, 512)).astype(np.float32)
WIDE_Y = rng.normal(size=(64, 1)).astype(np.float32)


def _wide_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="tanh"),
                             keras.layers.Dense(1024, activation="tanh"), keras.layers.Dense(1)])


def _wide_shards(steps):
    b = WIDE_X.shape[0] // steps // N
    return [(WIDE_X[s * b * N + R * b:s * b * N + (R + 1) * b],
             WIDE_Y[s * b * N + R * b:s * b * N + (R + 1) * b]) for s in range(steps)]


def _custom_loop(compression, wrap_tape, steps=4):
    """A tf.function loop whose gradients are reduced by the shim's tape
    (wrap_tape) or by its DistributedOptimizer."""
    model, opt = _wide_model(), keras.optimizers.SGD(0.01, momentum=0.9)
    if not wrap_tape:
        opt = hvd.DistributedOptimizer(opt, compression=compression)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        if wrap_tape:
            tape = hvd_tf.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for x, y in _wide_shards(steps):
        step(x, y)
    return model


def _tape_loop(compression):
    return _custom_loop(compression, wrap_tape=True)


def _optimizer_loop(compression):
    return _custom_loop(compression, wrap_tape=False)


def _optimizer_fit(compression, steps=4):
    model = _wide_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                                     compression=compression), loss="mse")
    shards = _wide_shards(steps)
    x = np.concatenate([x for x, _ in shards])
    y = np.concatenate([y for _, y in shards])
    model.fit(x, y, batch_size=len(shards[0][0]), epochs=1, verbose=0, shuffle=False)
    return model


def check_gradient_reductions_overlap_backprop_with_unchanged_results():
    """DistributedGradientTape and DistributedOptimizer (custom loop and fit),
    without and with fp16 compression: inside the traced step, gradient groups
    are reduced by ops free to start as soon as their gradients exist (the
    last layer's group does not wait for the first layer's gradient, no group
    waits for another), and the weights equal those of the same training with
    the groups chained in program order."""
    # Every trainer without compression, and fp16's cast ops in the tape and
    # in fit (the optimizer's custom loop runs the same reduction as fit).
    runs = [(_tape_loop, hvd.Compression.none), (_tape_loop, hvd.Compression.fp16),
            (_optimizer_loop, hvd.Compression.none), (_optimizer_fit, hvd.Compression.fp16)]
    for train, compression in runs:
        what = f"{train.__name__}, {compression.__name__}"
        with overlap_graph.recording_graphs() as graphs:
            overlapped = weights(train(compression))
        assert overlap_graph.overlaps(graphs, [512, 1024], [1024, 1]), what
        with overlap_graph.recording_graphs() as graphs, overlap_graph.chained():
            sequential = weights(train(compression))
        assert not overlap_graph.overlaps(graphs, [512, 1024], [1024, 1]), what
        for a, b in zip(overlapped, sequential):
            if N == 2:  # each element's sum is the same; at 4 ranks, to rounding
                np.testing.assert_array_equal(a, b, err_msg=what)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)
        same_on_all_ranks(overlapped)


def check_partial_distributed_optimizer_keeps_local_layers_local():
    shared, local = keras.layers.Dense(2, use_bias=False), keras.layers.Dense(1, use_bias=False)
    shared.build((None, 3))
    local.build((None, 2))
    shared.kernel.assign(np.ones((3, 2), np.float32))
    local.kernel.assign(np.ones((2, 1), np.float32))
    variables = [shared.kernel, local.kernel]
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    x = tf.constant(np.full((1, 3), R + 1, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))
    mean = np.mean([r + 1 for r in range(N)])
    np.testing.assert_allclose(shared.kernel.numpy(), 1.0 - mean, rtol=1e-6)  # averaged
    # The local layer's gradient (3 * (R + 1) per weight) stays local, divided by size.
    np.testing.assert_allclose(local.kernel.numpy(), 1.0 - 3 * (R + 1) / N, rtol=1e-6)


def check_sparse_embedding_gradients():
    keras.utils.set_random_seed(R)
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 3),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    ids = np.random.default_rng(R).integers(0, 10, size=(16, 2)).astype(np.int32)
    model.fit(ids, np.ones((16, 1), np.float32), batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_all_ranks(weights(model))


class _Logs(keras.callbacks.Callback):
    """Records each epoch's logs as this point of the callback list sees them."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def check_metric_average_callback():
    b = GLOBAL_BATCH // N
    model = make_model(seed=5)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    before, after = _Logs(), _Logs()
    model.fit(X[R::N], Y[R::N] * (R + 1), batch_size=b, epochs=2, verbose=0,
              callbacks=[before, hvd.callbacks.MetricAverageCallback(), after])
    for raw, averaged in zip(before.epochs, after.epochs):
        for key in ("loss", "mae"):
            everyone = ptf.allgather(tf.constant([float(raw[key])], tf.float64)).numpy()
            assert len(set(everyone)) == N  # ranks really had different values
            np.testing.assert_allclose(averaged[key], everyone.mean(), rtol=1e-6)


class _LearningRates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates, self.momenta = [], []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.rates.append(float(np.asarray(opt.learning_rate)))
        self.momenta.append(float(np.asarray(getattr(opt, "momentum", 0.0))))


def _fit_recording(optimizer, schedule, epochs, batches=3):
    model = make_model(seed=6)
    model.compile(optimizer=optimizer, loss="mse")
    recorder, logs = _LearningRates(), _Logs()
    model.fit(X[:batches * 8], Y[:batches * 8], batch_size=8, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[schedule, recorder, logs])
    return recorder, logs


def check_learning_rate_schedule_callback():
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.1, multiplier=0.5, start_epoch=1, end_epoch=3, momentum_correction=False)
    rec, logs = _fit_recording(hvd.DistributedOptimizer(keras.optimizers.SGD(0.2)), schedule, 4)
    expected = [0.2] * 3 + [0.1] * 3 + [0.05] * 3 + [0.05] * 3  # staircase, [1, 3)
    np.testing.assert_allclose(rec.rates, expected, rtol=1e-6)
    np.testing.assert_allclose([e["lr"] for e in logs.epochs], [0.2, 0.1, 0.05, 0.05],
                               rtol=1e-6)
    smooth = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=1.0, multiplier=lambda epoch: 1.0 / (1.0 + epoch), staircase=False,
        momentum_correction=False)
    rec, _ = _fit_recording(keras.optimizers.SGD(1.0), smooth, 2)
    epochs = [e + b / 3.0 for e in range(2) for b in range(3)]
    np.testing.assert_allclose(rec.rates, [1.0 / (1.0 + e) for e in epochs], rtol=1e-6)
    expect(ValueError, lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5),
           "initial_lr")


def check_learning_rate_warmup_callback():
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2,
                                                      momentum_correction=False)
    rec, _ = _fit_recording(keras.optimizers.SGD(0.4), warmup, 3)
    want = []
    for e in range(2):
        for b in range(3):
            epoch = e + b / 3.0 + 1.0 / 3.0
            want.append(0.4 / N * (epoch * (N - 1) / 2 + 1))
    want += [0.4] * 3  # after the warmup the last value (initial_lr) stays
    np.testing.assert_allclose(rec.rates, want, rtol=1e-6)


def check_momentum_correction():
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5,
                                                          start_epoch=1)
    legacy = getattr(getattr(keras.optimizers, "legacy", None), "SGD", None)
    try:
        optimizer = legacy(0.1, momentum=0.9)  # Keras 2: momentum is a hyperparameter
    except Exception:  # Keras 3: no legacy optimizers
        optimizer = None
    if optimizer is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_recording(keras.optimizers.SGD(0.1, momentum=0.9), schedule, 2)
        said = [w for w in caught if "momentum correction is skipped" in str(w.message)]
        # Once, from rank 0, naming Perseus-TF rather than quoting a line of it.
        assert len(said) == (R == 0) and all(w.filename == "Perseus-TF" for w in said), \
            [(w.filename, str(w.message)) for w in caught]
        return
    rec, _ = _fit_recording(hvd.DistributedOptimizer(optimizer), schedule, 3)
    # At the first batch of each epoch in range the rate changes and momentum is scaled by
    # new/old for that batch only.
    np.testing.assert_allclose(rec.rates, [0.1] * 3 + [0.1] * 3 + [0.05] * 3, rtol=1e-6)
    np.testing.assert_allclose(rec.momenta, [0.9] * 3 + [0.9, 0.9, 0.9] + [0.45, 0.9, 0.9],
                               rtol=1e-6)


def check_load_model_wraps_optimizer_with_its_state():
    model = make_model(seed=R)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
                  loss="mse")
    model.fit(X[R::N], Y[R::N], batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    iterations = int(model.optimizer.iterations.numpy())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"rank{R}.keras")
        model.save(path)
        loaded = hvd.load_model(path)
        plain = keras.models.load_model(path)  # loads without the shim, too
    assert is_distributed(loaded.optimizer), type(loaded.optimizer).__mro__
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert not is_distributed(plain.optimizer)
    assert int(loaded.optimizer.iterations.numpy()) == iterations
    for a, b in zip(weights(model), weights(loaded)):
        np.testing.assert_array_equal(a, b)
    loaded.fit(X[R::N], Y[R::N], batch_size=8, epochs=1, verbose=0)
    same_on_all_ranks(weights(loaded))


def check_keras_collectives():
    got = hvd.allreduce(np.array([R, 2.0 * R], np.float32))  # Average by default
    np.testing.assert_allclose(got.numpy(), [(N - 1) / 2, N - 1])
    got = hvd.allreduce(np.array([R], np.float32), op=hvd.Sum)
    assert got.numpy()[0] == N * (N - 1) / 2
    np.testing.assert_array_equal(hvd.allgather(np.array([[R]])).numpy().ravel(), range(N))
    np.testing.assert_array_equal(hvd.broadcast(np.array([R, R]), root_rank=N - 1).numpy(),
                                  [N - 1, N - 1])
    got = hvd.reducescatter(np.ones((N, 2), np.float32) * (R + 1))
    np.testing.assert_allclose(got.numpy(), [[(N + 1) / 2] * 2])
    assert hvd.allgather_object(R) == list(range(N))


def check_sync_batch_normalization_sees_the_global_batch():
    # Every rank's 8 rows together are one process's batch of 8N: outputs,
    # moving statistics and gradients equal that process's, Keras 2 and 3.
    rng = np.random.default_rng(5)
    full = (rng.normal(2.0, 3.0, (8 * N, 3)) * (1 + np.arange(3))).astype(np.float32)
    weights = rng.normal(0.0, 1.0, (8 * N, 3)).astype(np.float32)
    rows = slice(8 * R, 8 * (R + 1))
    layer = hvd_tf.SyncBatchNormalization(momentum=0.0, epsilon=1e-3)
    alone = keras.layers.BatchNormalization(momentum=0.0, epsilon=1e-3)
    with tf.GradientTape() as tape:
        out = layer(tf.constant(full[rows]), training=True)
        loss = tf.reduce_sum(out * weights[rows])
    grads = tape.gradient(loss, [layer.gamma, layer.beta])
    with tf.GradientTape() as tape:
        want = alone(tf.constant(full), training=True)
        want_loss = tf.reduce_sum(want * weights)
    want_grads = tape.gradient(want_loss, [alone.gamma, alone.beta])
    np.testing.assert_allclose(out.numpy(), want.numpy()[rows], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), alone.moving_mean.numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), alone.moving_variance.numpy(),
                               rtol=1e-4, atol=1e-4)
    # Each rank's gradient is its rows' part; summed over the ranks, the whole.
    for got, expected in zip(grads, want_grads):
        total = hvd_tf.allreduce(got, op=hvd_tf.Sum).numpy()
        np.testing.assert_allclose(total, expected.numpy(), rtol=1e-4, atol=1e-4)
    # Inference uses the moving statistics: no collective, same everywhere.
    same_on_all_ranks([layer(tf.constant(full[:4]), training=False).numpy()])


# Mixed precision: a batch that overflows float16 on one rank only. Rank 0's
# third batch and the last rank's sixth hold a value float16 cannot carry, so
# their gradients are not finite; every rank must skip those steps together,
# as one process training on the global batches does.
BAD_STEPS = {2: 0, 5: -1}  # batch in the epoch -> the rank whose shard holds the bad row


def _overflowing_data():
    x, y = X.copy(), Y / 4.0  # small targets: no other step overflows, at any batch size
    for step, rank in BAD_STEPS.items():
        x[step * GLOBAL_BATCH + (rank % N) * (GLOBAL_BATCH // N)] = 1e5
    return x, y


def _loss_scale(opt):
    scale = getattr(opt, "dynamic_scale", None)  # Keras 3
    return float(np.asarray(scale if scale is not None else opt.loss_scale))


class _mixed_float16:
    def __enter__(self):
        keras.mixed_precision.set_global_policy("mixed_float16")

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy("float32")


def _mixed_reference(epochs):
    """One process on the global batches: (weights, loss scale, iterations)."""
    x, y = _overflowing_data()
    with _mixed_float16():
        ref = make_model(seed=0)
        ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        ref.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    opt = ref.optimizer
    return weights(ref), _loss_scale(opt), int(opt.iterations.numpy())


def _expect_mixed_reference(model, reference, what, opt=None):
    want_weights, want_scale, want_iterations = reference
    opt = opt or model.optimizer
    got = [_loss_scale(opt), int(opt.iterations.numpy())]
    everyone = ptf.allgather(tf.constant([got], tf.float64)).numpy()
    # Every rank skipped the same steps: the loss scale halved once per skip.
    assert (everyone == [[want_scale, want_iterations]] * N).all(), (what, everyone.tolist(),
                                                                      want_scale, want_iterations)
    assert want_scale == 2.0 ** 15 / 2 ** (2 * len(BAD_STEPS)), want_scale  # 2 epochs
    same_on_all_ranks(weights(model))
    for a, r in zip(weights(model), want_weights):
        np.testing.assert_allclose(a, r, rtol=1e-2, atol=2e-3, err_msg=what)


def check_mixed_precision_fit_skips_a_step_that_overflows_on_one_rank_everywhere():
    """`fit` under the mixed_float16 policy (Keras wraps the DistributedOptimizer
    in a LossScaleOptimizer), without and with fp16 compression; Keras 2's
    legacy optimizers too."""
    reference = _mixed_reference(epochs=2)
    b = GLOBAL_BATCH // N
    x, y = _overflowing_data()
    legacy = getattr(getattr(keras.optimizers, "legacy", None), "SGD", None)
    runs = [(keras.optimizers.SGD, hvd.Compression.none), (keras.optimizers.SGD,
                                                           hvd.Compression.fp16)]
    if legacy is not None and not hasattr(keras.optimizers.Optimizer, "stateless_apply"):
        runs.append((legacy, hvd.Compression.none))  # Keras 2 only
    for optimizer, compression in runs:
        with _mixed_float16():
            model = make_model(seed=R)
            model.compile(optimizer=hvd.DistributedOptimizer(optimizer(0.05),
                                                             compression=compression),
                          loss="mse")
            model.fit(my_shard(x, b), my_shard(y, b), batch_size=b, epochs=2, shuffle=False,
                      verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        _expect_mixed_reference(model, reference, f"{optimizer.__module__}, "
                                                  f"{compression.__name__}")


def check_mixed_precision_custom_loop_skips_a_step_that_overflows_on_one_rank_everywhere():
    """A tf.function loop with LossScaleOptimizer(DistributedOptimizer(opt)),
    as the shim's error message recommends, Keras 2 and 3; and with local
    gradient accumulation, where a pass that overflows skips the step its
    sum belongs to on every rank."""
    reference = _mixed_reference(epochs=2)
    b = GLOBAL_BATCH // N
    x, y = _overflowing_data()
    keras3 = hasattr(keras.optimizers.Optimizer, "stateless_apply")
    with _mixed_float16():  # the other way round is refused, naming this one
        expect(ValueError, lambda: hvd.DistributedOptimizer(
            keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))),
            "LossScaleOptimizer(...) around it")
    for passes in (1, 2):
        with _mixed_float16():
            model = make_model(seed=0)
            opt = keras.mixed_precision.LossScaleOptimizer(hvd.DistributedOptimizer(
                keras.optimizers.SGD(0.05), backward_passes_per_step=passes,
                average_aggregated_gradients=True))

            @tf.function
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    out = tf.cast(model(xb, training=True), tf.float32)
                    loss = tf.reduce_mean((out - yb) ** 2)
                    scaled = opt.scale_loss(loss) if keras3 else opt.get_scaled_loss(loss)
                grads = tape.gradient(scaled, model.trainable_variables)
                if not keras3:
                    grads = opt.get_unscaled_gradients(grads)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            mine_x, mine_y = my_shard(x, b), my_shard(y, b)
            for _ in range(2):
                for t in range(0, len(mine_x), b):
                    step(mine_x[t:t + b], mine_y[t:t + b])
        if passes == 1:
            _expect_mixed_reference(model, reference, "custom loop", opt)
        else:  # steps of 2 passes: the 2nd (bad 3rd pass) and 3rd (bad 6th) skip
            scale = ptf.allgather(tf.constant([_loss_scale(opt)], tf.float64)).numpy()
            assert (scale == 2.0 ** 15 / 2 ** 4).all(), scale.tolist()
            same_on_all_ranks(weights(model))


class _reports_a_gpu:
    """TF says it has a GPU, as Keras 3 asks when it resolves
    jit_compile="auto" (the collectives run on the CPU all the same)."""

    def __enter__(self):
        self.real = tf.config.list_physical_devices
        fake = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")

        def list_physical_devices(device_type=None):
            found = self.real(device_type)
            return found + [fake] if device_type in (None, "GPU") else found
        tf.config.list_physical_devices = list_physical_devices

    def __exit__(self, *exc):
        tf.config.list_physical_devices = self.real


def check_jit_compile_is_turned_off_around_the_gradient_allreduce():
    """A default Keras 3 script on a GPU machine (jit_compile="auto" turns
    XLA on by itself) and an explicit jit_compile=True (Keras 2 and 3): the
    model trains, without XLA, after one warning line that says why. Once
    the first step failed with "Graph execution error"."""
    b = GLOBAL_BATCH // N
    keras3 = hasattr(keras.optimizers.Optimizer, "stateless_apply")
    for asked in (["auto", True] if keras3 else [True]):
        model = make_model(seed=0)
        with _reports_a_gpu(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kwargs = {} if asked == "auto" else {"jit_compile": asked}
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                          loss="mse", **kwargs)
            model.fit(my_shard(X, b), my_shard(Y, b), batch_size=b, epochs=1, shuffle=False,
                      verbose=0)
        same_on_all_ranks(weights(model))  # before what one rank alone could fail
        said = [w for w in caught if "Perseus-TF: jit_compile" in str(w.message)]
        # Rank 0 says it, naming Perseus-TF rather than quoting a line of it.
        assert len(said) == (R == 0), [str(w.message) for w in caught]
        for w in said:
            text = str(w.message)
            assert w.filename == "Perseus-TF" and "\n" not in text, (w.filename, text)
            assert "jit_compile=True is turned off" in text and "no XLA kernels" in text, text
        assert not model.jit_compile
    # A model without the shim's optimizer keeps what Keras chose.
    plain = make_model(seed=0)
    with _reports_a_gpu():
        plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
        plain.make_train_function()
    assert plain.jit_compile
