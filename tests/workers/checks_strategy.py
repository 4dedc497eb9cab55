"""PerseusStrategy with Keras and custom loops, at 2 ranks (none of these
checks branches on the world size or has a case that only more ranks reach
but predict's, which tests/test_strategy.py also runs at 3; `fit` under
PerseusStrategy at 4 ranks runs in tests/test_model_matrix.py).

Rank 0 also trains the same model without any strategy on the same global
data: the distributed weights must equal that single-process result.
"""

import os
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
from perseus_tf import _native

import overlap_graph
from rank_checks import expect, interrupting_callback, same_on_all_ranks, shared_tempdir

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras    # Keras 2 on TF >= 2.16 (tests/test_keras_versions.py)
else:
    try:
        import keras
    except ImportError:  # pragma: no cover
        keras = tf.keras

R = N = STRATEGY = None
GLOBAL_BATCH = 16
rng = np.random.default_rng(0)
X = rng.normal(size=(96, 6)).astype(np.float32)
Y = (X @ rng.normal(size=(6, 1)) + 0.1).astype(np.float32)
LABELS = (X[:, 0] > 0).astype(np.int64)


def setup():
    global R, N, STRATEGY
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    STRATEGY = ptf.PerseusStrategy()
    R, N = ptf.rank(), ptf.size()
    return R


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def dataset(n=96):
    return tf.data.Dataset.from_tensor_slices((X[:n], Y[:n])).batch(GLOBAL_BATCH)


def check_keras_patches_in_order_found_and_undone():
    """perseus_tf/patches.py on this Keras: every target of every patch that
    applies to it exists (a Keras release that renamed one fails here), the
    strategy applied each of them (none skipped) in the table's order, taking
    them off leaves Keras as it was, and taking one from the middle and
    putting it back restores the order (the checks after this one train
    through the patches put back)."""
    from perseus_tf import _gradient_marks, _keras, patches
    from perseus_tf import strategy as strategy_module

    assert patches.missing_targets() == [], patches.missing_targets()
    flavours = [None] + _keras.in_use()
    wanted = patches.STRATEGY + (patches.STRATEGY_MULTI_RANK if N > 1 else ())
    expected = [(p.name, None if f is None else f.name) for p in patches.PATCHES
                if p.name in wanted for f in flavours if patches.applies(p, f)]
    applied = patches.installed()
    assert [a for a in applied if a[0] in wanted] == expected, (applied, expected)

    def current():
        values = {}
        for p in patches.PATCHES:
            for f in flavours:
                if patches.applies(p, f):
                    for t in p.targets:
                        owner, name, _ = patches._resolve(t, f)
                        values[(t, f and f.name)] = vars(owner).get(name)
        return values

    patched = current()
    patches.uninstall()
    assert patches.installed() == []
    plain = current()
    changed = [k for k in plain if plain[k] is not patched[k]]
    assert len(changed) >= 20, changed   # every patch replaced something
    strategy_module.install_patches()
    assert patches.installed() == applied
    patches.uninstall(["files.step_resume", "files.step_resume_keras2"])
    assert all(a[0] not in ("files.step_resume", "files.step_resume_keras2")
               for a in patches.installed())
    strategy_module.install_patches()
    assert patches.installed() == applied, (patches.installed(), applied)
    patches.uninstall()
    after = current()
    assert all(after[k] is plain[k] for k in plain), [k for k in plain if after[k] is not plain[k]]
    strategy_module.install_patches()

    # Gradient reductions are told apart per thread, and the mark travels
    # into the merge calls (the reductions) a marked replica makes.
    seen = []
    inside, release = threading.Event(), threading.Event()

    def hold():
        with _gradient_marks.gradient_reduction():
            inside.set()
            release.wait(60)

    other = threading.Thread(target=hold)
    other.start()
    try:
        assert inside.wait(60)
        assert not _gradient_marks.active(), "another thread's gradient mark is seen here"
    finally:
        release.set()
        other.join()

    def replica_fn():
        context = tf.distribute.get_replica_context()
        with _gradient_marks.gradient_reduction():
            context.merge_call(lambda s: seen.append(("marked", _gradient_marks.active())))
        context.merge_call(lambda s: seen.append(("plain", _gradient_marks.active())))

    STRATEGY.run(replica_fn)
    assert ("marked", True) in seen and ("plain", False) in seen, seen
    assert ("marked", False) not in seen and ("plain", True) not in seen, seen


def check_replicas_and_variables_start_equal():
    assert STRATEGY.num_replicas_in_sync == N
    with STRATEGY.scope():
        model = make_model(seed=R)  # each rank draws different initial values
    same_on_all_ranks([w.numpy() for w in model.weights])


def _fit_and_compare(n_examples, epochs):
    with STRATEGY.scope():
        model = make_model(seed=R)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    start = [w.numpy() for w in model.weights]
    history = model.fit(dataset(n_examples), epochs=epochs, verbose=0)
    result = model.evaluate(dataset(n_examples), verbose=0)
    same_on_all_ranks([w.numpy() for w in model.weights])
    same_on_all_ranks([history.history["loss"], result])
    ref = make_model(seed=0)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    for v, s in zip(ref.weights, start):
        v.assign(s)
    ref_history = ref.fit(dataset(n_examples), epochs=epochs, verbose=0, shuffle=False)
    ref_result = ref.evaluate(dataset(n_examples), verbose=0)
    for a, b in zip(model.weights, ref.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    np.testing.assert_allclose(result, ref_result, rtol=1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    return model


def check_cluster_resolver_as_multi_worker_mirrored_strategy():
    """The tutorial's chief-only saving code reads these."""
    resolver = STRATEGY.cluster_resolver
    assert resolver is not None
    assert (resolver.task_type, resolver.task_id) == ("worker", R)
    spec = resolver.cluster_spec()
    assert spec.jobs == ["worker"] and spec.num_tasks("worker") == N, spec.as_dict()
    assert spec.as_dict()["worker"] == ["127.0.0.1"] * N, spec.as_dict()
    is_chief = resolver.task_type == "worker" and resolver.task_id == 0
    assert is_chief == (R == 0)


def check_placement_and_one_rank_per_gpu_through_the_allgather():
    """No GPU here: the replicas train on the CPU. The host-address
    allgather also carries each rank's GPU: with NCCL, two ranks of one host
    naming one GPU fail on every rank, one GPU each passes."""
    import dataclasses

    from perseus_tf import gpu
    from perseus_tf import strategy as strategy_module

    assert STRATEGY.placement.device == "/cpu:0", STRATEGY.placement
    running = _native.config()
    _native._config_in_use = dataclasses.replace(running, gpu_transport="nccl")
    try:
        expect(RuntimeError,
               lambda: strategy_module._cluster_resolver(gpu.Placement("/gpu:0", 0, "3")),
               f"ranks 0 and 1 both train on GPU 3 of host 127.0.0.1", "PERSEUS_GPU_TRANSPORT")
        own = strategy_module._cluster_resolver(gpu.Placement("/gpu:0", 0, f"GPU-{R}"))
        assert own.cluster_spec().as_dict()["worker"] == ["127.0.0.1"] * N
    finally:
        _native._config_in_use = running


def check_fit_equals_single_process_sgd():
    before = _native.stats()
    _fit_and_compare(96, epochs=3)
    after = _native.stats()
    # The gradients ran from an offline plan (PERSEUS_OFFLINE_NEG unset = auto)
    # for most of the 18 steps, and the result is still exact.
    assert after["offline_steps"] - before["offline_steps"] >= 10, (before, after)
    # The launch compares the ranks' plans every 3 plan steps (they agree).
    every = int(os.environ.get("PERSEUS_OFFLINE_NEG_CHECK_N_STEPS", "0"))
    if every:
        checks = after["plan_checks"] - before["plan_checks"]
        assert checks >= (after["offline_steps"] - before["offline_steps"]) // every, (before, after)


def check_fit_with_last_partial_batch():
    # 88 examples, global batch 16: the last batch has 8 (2 or 4 ranks share it).
    _fit_and_compare(88, epochs=2)


def check_custom_training_loop_equals_single_process():
    with STRATEGY.scope():
        model = make_model(seed=R)
        opt = keras.optimizers.SGD(0.05)
    start = [w.numpy() for w in model.weights]
    dist = STRATEGY.experimental_distribute_dataset(dataset())

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum((model(x) - y) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(x, y):
        return STRATEGY.reduce("SUM", STRATEGY.run(step, args=(x, y)), axis=None)

    losses = [float(train_step(x, y)) for x, y in dist]
    same_on_all_ranks([w.numpy() for w in model.weights] + [losses])
    ref = make_model(seed=0)
    for v, s in zip(ref.weights, start):
        v.assign(s)
    ref_opt = keras.optimizers.SGD(0.05)
    for x, y in dataset():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum((ref(x) - y) ** 2, axis=1))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))
    for a, b in zip(model.weights, ref.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)


def check_strategy_reduce_gather_and_int_values():
    def replica_value():
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.cast(tf.fill([2, 3], rid + 1), tf.float32), tf.cast(rid + 1, tf.int32), \
            tf.cast(rid + 1, tf.int64)

    f, i32, i64 = STRATEGY.run(tf.function(replica_value))
    total = N * (N + 1) / 2
    np.testing.assert_allclose(STRATEGY.reduce("SUM", f, axis=None).numpy(), np.full((2, 3), total))
    np.testing.assert_allclose(STRATEGY.reduce("MEAN", f, axis=None).numpy(),
                               np.full((2, 3), total / N))
    np.testing.assert_allclose(STRATEGY.reduce("SUM", f, axis=0).numpy(), np.full(3, 2 * total))
    np.testing.assert_allclose(STRATEGY.reduce("MEAN", f, axis=0).numpy(), np.full(3, total / N))
    assert int(STRATEGY.reduce("SUM", i32, axis=None)) == total
    assert int(STRATEGY.reduce("SUM", i64, axis=None)) == total
    gathered = STRATEGY.gather(f, axis=0).numpy()
    np.testing.assert_allclose(gathered[:, 0], np.repeat(np.arange(1, N + 1), 2))
    gathered = STRATEGY.gather(f, axis=1).numpy()
    assert gathered.shape == (2, 3 * N)


def check_replica_context_all_reduce_dense_and_indexed_slices():
    @tf.function
    def fn():
        ctx = tf.distribute.get_replica_context()
        rid = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        dense = ctx.all_reduce("SUM", tf.ones([3]) * (rid + 1))
        sparse = tf.IndexedSlices(values=tf.ones([1, 2]) * (rid + 1),
                                  indices=tf.constant([0]), dense_shape=tf.constant([3, 2]))
        reduced = ctx.all_reduce("SUM", sparse)
        return dense, tf.convert_to_tensor(reduced)

    dense, sparse = STRATEGY.run(fn)
    total = N * (N + 1) / 2
    np.testing.assert_allclose(dense.numpy(), np.full(3, total))
    np.testing.assert_allclose(sparse.numpy(), [[total, total], [0, 0], [0, 0]])


def check_checkpoint_written_by_rank0_and_restored_everywhere():
    shared = tf.constant(tempfile.mkdtemp(prefix="perseus-ckpt-") if R == 0 else "")
    # Every rank needs rank 0's directory name: broadcast its bytes.
    name = ptf.broadcast(tf.constant(list(shared.numpy()) + [0] * (200 - len(shared.numpy())),
                                     tf.uint8), root_rank=0).numpy()
    directory = bytes(name).rstrip(b"\0").decode()
    path = os.path.join(directory, "model.weights.h5")
    with STRATEGY.scope():
        model = make_model(seed=R)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    callback = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    model.fit(dataset(), epochs=1, verbose=0, callbacks=[callback])
    ptf.barrier()
    files = sorted(os.listdir(directory))
    assert files == ["model.weights.h5"], files
    trained = [w.numpy() for w in model.weights]
    with STRATEGY.scope():
        restored = make_model(seed=100 + R)
        restored.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    restored.load_weights(path)
    for a, b in zip(restored.weights, trained):
        np.testing.assert_allclose(a.numpy(), b, atol=0)
    restored.fit(dataset(), epochs=1, verbose=0)  # and training continues in step
    same_on_all_ranks([w.numpy() for w in restored.weights])


def _local_replica_sum(strategy):
    @tf.function
    def fn():
        ctx = tf.distribute.get_replica_context()
        local = tf.cast(ctx.replica_id_in_sync_group % 2 + 1, tf.float32)  # 1, 2 per process
        return ctx.all_reduce("SUM", tf.fill([2], local))

    return [v.numpy() for v in strategy.experimental_local_results(strategy.run(fn))]


def check_cross_device_ops_in_stock_mirrored_strategy():
    # Stock MirroredStrategy over two logical CPUs of this process: the
    # replica all-reduce (the gradient path) runs through our ops, local
    # devices first, then across the N processes.
    cpus = tf.config.list_logical_devices("CPU")
    assert len(cpus) >= 2, cpus
    mirrored = tf.distribute.MirroredStrategy(
        [cpus[0].name, cpus[1].name], cross_device_ops=ptf.PerseusCrossDeviceOps())
    for got in _local_replica_sum(mirrored):
        np.testing.assert_allclose(got, [3.0 * N] * 2)


def check_strategy_with_two_local_devices_per_process():
    cpus = tf.config.list_logical_devices("CPU")
    strategy = ptf.PerseusStrategy(devices=[cpus[0].name, cpus[1].name])
    assert strategy.num_replicas_in_sync == 2 * N
    for got in _local_replica_sum(strategy):
        np.testing.assert_allclose(got, [3.0 * N] * 2)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group)))
    assert float(strategy.reduce("SUM", values, axis=None)) == sum(range(2 * N))


KERAS3 = keras.__version__.startswith("3.")


def check_mixed_precision_overflow_on_one_rank_skips_step_everywhere():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with STRATEGY.scope():
            keras.utils.set_random_seed(R)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        opt = model.optimizer
        assert isinstance(opt, keras.mixed_precision.LossScaleOptimizer), type(opt)
        scale = (lambda: float(opt.dynamic_scale.numpy())) if KERAS3 else (
            lambda: float(opt.loss_scale.numpy()))
        before, scale0 = [w.numpy() for w in model.weights], 2.0 ** 15  # the initial scale
        # One global batch of N rows; exactly one row (on one rank's shard)
        # makes the float16 gradients overflow.
        x = np.full((N, 6), 0.1, np.float32)
        x[0] = 3000.0
        y = np.zeros((N, 1), np.float32)
        model.fit(x, y, batch_size=N, epochs=1, verbose=0, shuffle=False)
        after = [w.numpy() for w in model.weights]
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)  # skipped on every rank
        assert scale() == scale0 / 2, (scale0, scale())
        # A normal step then updates every rank identically.
        model.fit(np.full((N, 6), 0.1, np.float32), y, batch_size=N, epochs=1, verbose=0)
        changed = [w.numpy() for w in model.weights]
        assert any(not np.array_equal(a, b) for a, b in zip(after, changed))
        same_on_all_ranks(changed + [[scale()]])
    finally:
        keras.mixed_precision.set_global_policy("float32")


def check_mixed_precision_skipped_step_keeps_the_offline_plan():
    """A step that mixed precision skips (one rank's float16 gradients
    overflow, after the gradients run from an offline plan) leaves the plan
    alone: the ranks' agreement to skip is no gradient, and the skipped
    step reduces no gradients, so the plan does not wait for them (it once
    waited its 10 s deadline, or voted at once, and left the plan, on every
    skipped step, to learn the step again)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with STRATEGY.scope():
            keras.utils.set_random_seed(R)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    opt = model.optimizer
    scale = (lambda: float(opt.dynamic_scale.numpy())) if KERAS3 else (
        lambda: float(opt.loss_scale.numpy()))
    steps, bad = 30, 20
    x = np.full((steps * N, 6), 0.1, np.float32)
    x[bad * N + N - 1] = 3000.0   # the last rank's row of batch 20 overflows
    y = np.zeros((steps * N, 1), np.float32)
    before = _native.stats()
    model.fit(x, y, batch_size=N, epochs=1, verbose=0, shuffle=False)
    after = _native.stats()
    assert scale() == 2.0 ** 14, scale()   # one step skipped, on every rank
    plans, timeouts, offline = (after[k] - before[k]
                                for k in ("plans", "plan_timeouts", "offline_steps"))
    # The step was learned once and never left (not even at once, by a vote).
    assert plans == 1, f"{plans} offline plans made for one step"
    assert timeouts == 0, f"the plan waited out its deadline {timeouts} times"
    assert offline >= steps - bad, f"{offline} offline steps of {steps}"
    same_on_all_ranks([w.numpy() for w in model.weights])


def check_sync_batch_norm_uses_global_batch_statistics():
    with STRATEGY.scope():
        if KERAS3:
            bn = keras.layers.BatchNormalization(synchronized=True, momentum=0.0)
        else:
            bn = tf.keras.layers.experimental.SyncBatchNormalization(momentum=0.0)
        model = keras.Sequential([keras.Input((6,)), bn])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x = X[:GLOBAL_BATCH]
    model.fit(x, np.zeros_like(x), batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    # momentum 0: the moving statistics are exactly the last batch's.
    np.testing.assert_allclose(bn.moving_mean.numpy(), x.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), x.var(0), rtol=1e-4, atol=1e-6)
    # Each rank's shard alone would give different statistics.
    shard = x[R::N]
    assert not np.allclose(shard.mean(0), x.mean(0), atol=1e-3)


def check_model_save_and_reload_continue_training():
    with STRATEGY.scope():
        model = make_model(seed=R)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    model.fit(dataset(), epochs=1, verbose=0)
    # Saving reads metrics (collectives): every rank saves, each to its own place.
    path = os.path.join(tempfile.mkdtemp(prefix=f"perseus-save{R}-"),
                        "model.keras" if KERAS3 else "model")
    model.save(path)
    with STRATEGY.scope():
        loaded = keras.models.load_model(path)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(loaded.predict(X[:8], verbose=0), model.predict(X[:8], verbose=0),
                               rtol=1e-6)
    loaded.fit(dataset(), epochs=1, verbose=0)
    model.fit(dataset(), epochs=1, verbose=0)
    for a, b in zip(model.weights, loaded.weights):  # same optimizer state, same result
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    same_on_all_ranks([w.numpy() for w in loaded.weights])


def check_tensorboard_logs_written_by_rank0_only():
    directory = shared_tempdir("perseus-tb-")
    with STRATEGY.scope():
        model = make_model(seed=R)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(dataset(), epochs=2, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(log_dir=directory)])
    ptf.barrier()
    events = [f for _, _, fs in os.walk(directory) for f in fs if "tfevents" in f]
    assert len(events) == 1, events  # one writer (rank 0), one run ("train")


def check_backup_and_restore_resumes_on_every_rank():
    directory = shared_tempdir("perseus-backup-")
    with STRATEGY.scope():
        model = make_model(seed=R)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    backup = keras.callbacks.BackupAndRestore(backup_dir=directory)
    if KERAS3 and not hasattr(backup, "_training_metadata_path"):
        # Keras 3.0 saves no epoch to resume at: the feature says so, on every rank.
        from perseus_tf._keras import KerasVersionError
        expect(KerasVersionError, lambda: model.fit(dataset(), epochs=3, verbose=0,
                                                    callbacks=[backup]),
               "BackupAndRestore (resuming at the saved epoch) needs Keras 3.1 or newer")
        return
    expect(RuntimeError, lambda: model.fit(dataset(), epochs=3, verbose=0,
                                           callbacks=[backup, interrupting_callback(keras)]),
           "interrupted")
    ptf.barrier()
    assert os.listdir(directory), "rank 0 wrote no backup"
    after_one = [w.numpy() for w in model.weights]
    with STRATEGY.scope():
        resumed = make_model(seed=50 + R)
        resumed.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = resumed.fit(dataset(), epochs=3, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup_dir=directory)])
    assert history.epoch == [1, 2], history.epoch  # epoch 0 was not run again
    same_on_all_ranks([w.numpy() for w in resumed.weights])
    assert any(not np.allclose(a, b) for a, b in zip(after_one, resumed.weights))


def check_accumulation_equals_a_larger_batch():
    """accumulate_n_steps=2 (PERSEUS_ACCUMULATE_N_STEPS) at global batch 8
    equals single-process training at batch 16 (SGD with momentum and
    weight decay, so a skipped or extra update or decay would show), in fit
    and in a custom loop, and gradients cross processes on every second
    step only."""
    strategy = ptf.PerseusStrategy(accumulate_n_steps=2)
    momentum = lambda: keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=0.05)  # noqa: E731
    data = lambda batch: tf.data.Dataset.from_tensor_slices((X, Y)).batch(batch)  # noqa: E731
    with strategy.scope():
        model = make_model(seed=R)
        model.compile(optimizer=momentum(), loss="mse")
        loop_model = make_model(seed=R)
        loop_opt = momentum()
    start = [w.numpy() for w in model.weights]
    loop_start = [w.numpy() for w in loop_model.weights]
    before = _native.stats()
    model.fit(data(8), epochs=2, verbose=0)
    after = _native.stats()

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum((loop_model(x) - y) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
        grads = tape.gradient(loss, loop_model.trainable_variables)
        loop_opt.apply_gradients(zip(grads, loop_model.trainable_variables))

    @tf.function
    def train_step(x, y):
        strategy.run(step, args=(x, y))

    for x, y in strategy.experimental_distribute_dataset(data(8)):
        train_step(x, y)
    same_on_all_ranks([w.numpy() for w in model.weights + loop_model.weights])
    for what, trained, initial, epochs in (("fit", model, start, 2),
                                           ("custom loop", loop_model, loop_start, 1)):
        ref = make_model(seed=0)
        ref.compile(optimizer=momentum(), loss="mse")
        for v, s in zip(ref.weights, initial):
            v.assign(s)
        ref.fit(data(16), epochs=epochs, verbose=0, shuffle=False)
        for a, b in zip(trained.weights, ref.weights):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5, err_msg=what)
    # 24 steps of fit, 12 gradient reductions: 12 x 65 float32 gradients
    # (plus metrics, which stay per step).
    data_bytes = sum(s["bytes"] for s in after["streams"] + [after["online_stream"]]) - sum(
        s["bytes"] for s in before["streams"] + [before["online_stream"]])
    grads_every_step = 24 * 65 * 4
    assert data_bytes < grads_every_step, data_bytes


def _wide_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="tanh"),
                             keras.layers.Dense(1024, activation="tanh"), keras.layers.Dense(1)])


WIDE_X = rng.normal(size=(64, 512)).astype(np.float32)
WIDE_Y = rng.normal(size=(64, 1)).astype(np.float32)


def _wide_custom_loop(steps):
    """Trains the wide model with a custom loop; returns (weights, graphs)."""
    with overlap_graph.recording_graphs() as graphs:
        with STRATEGY.scope():
            model = _wide_model(seed=5)
            opt = keras.optimizers.SGD(0.01, momentum=0.9)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def train_step(x, y):
            STRATEGY.run(step, args=(x, y))

        b = WIDE_X.shape[0] // N
        for s in range(steps):
            rows = slice(R * b, (R + 1) * b)
            train_step(WIDE_X[rows] * (1 + 0.1 * s), WIDE_Y[rows])
    return [w.numpy() for w in model.weights], graphs


def _wide_fit(steps):
    """Trains the wide model with Keras fit; returns (weights, graphs)."""
    with overlap_graph.recording_graphs() as graphs:
        with STRATEGY.scope():
            model = _wide_model(seed=6)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        data = tf.data.Dataset.from_tensor_slices((WIDE_X, WIDE_Y)).batch(
            WIDE_X.shape[0] // steps)
        model.fit(data, epochs=1, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights], graphs


def _same_weights(a, b, what):
    # Each element's sum is the same at 2 ranks; at 4 the fused layout may
    # change which rank's ring segment adds it first (float rounding).
    for x, y in zip(a, b):
        if N == 2:
            np.testing.assert_array_equal(x, y, err_msg=what)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=what)


def check_gradient_reductions_overlap_backprop_with_unchanged_results():
    """In a custom loop and in fit, gradients are reduced in several groups,
    each free to start as soon as its gradients exist: the last layer's group
    does not wait for the first layer's gradient, and no group waits for
    another (so they run while backprop goes on). The weights equal those of
    the same training with the groups chained in program order."""
    for train in (_wide_custom_loop, _wide_fit):
        overlapped, graphs = train(steps=4)
        assert overlap_graph.overlaps(graphs, [512, 1024], [1024, 1]), train.__name__
        with overlap_graph.chained():
            sequential, chained_graphs = train(steps=4)
        # The chained run is the non-overlapped path (so the check can fail).
        assert not overlap_graph.overlaps(chained_graphs, [512, 1024], [1024, 1])
        _same_weights(overlapped, sequential, train.__name__)
        same_on_all_ranks(overlapped)


def _bn_model():
    with STRATEGY.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
    return model


def _scaled_shards():
    # Each rank's shard has a different scale, so the local statistics differ.
    x = X * (1.0 + np.arange(len(X))[:, None] / 16.0)
    return tf.data.Dataset.from_tensor_slices((x, Y)).batch(GLOBAL_BATCH)


def _local(variable):
    # Keras 3 wraps a tf.Variable. (No getattr probe on Keras 2's own: a
    # sync-on-read variable would answer it with a collective.)
    tf_variable = variable if isinstance(variable, tf.Variable) else variable._value
    return np.asarray(tf_variable.values[0].numpy(), np.float64)


class _LastBatchStatistics(keras.callbacks.Callback if keras else object):
    """This rank's own batch-norm statistics after the last batch, before
    the epoch's end averages them."""

    def __init__(self, bn):
        super().__init__()
        self.bn, self.seen = bn, None

    def on_train_batch_end(self, batch, logs=None):
        self.seen = [_local(self.bn.moving_mean), _local(self.bn.moving_variance)]


def check_batch_norm_moving_statistics_are_averaged_when_read():
    """Decision (docs/strategy.md): each rank updates its own batch-norm moving
    statistics during training (no communication); reading them outside a
    replica (get_weights) gives their average over the ranks, on Keras 2 and
    Keras 3 alike, and at each epoch's end in fit every rank's copy becomes
    that average, so every rank saves the same model."""
    model = _bn_model()
    bn = model.layers[1]
    last = _LastBatchStatistics(bn)
    model.fit(_scaled_shards(), epochs=2, verbose=0, callbacks=[last])
    for own, variable in zip(last.seen, (bn.moving_mean, bn.moving_variance)):
        everyone = ptf.allgather(tf.constant(own[None, :])).numpy()
        assert not np.allclose(everyone[0], everyone[-1]), "shards gave the same statistics"
        read = np.asarray(variable.numpy(), np.float64)
        np.testing.assert_allclose(read, everyone.mean(axis=0), rtol=1e-6)
        # After fit every rank holds the average itself.
        np.testing.assert_allclose(_local(variable), read, rtol=1e-6)
        same_on_all_ranks([read])
    same_on_all_ranks([w for w in model.get_weights()])


def check_model_saved_by_rank_0_alone_is_whole_and_quick():
    # The Horovod habit `if rank == 0: model.save(path)` after fit, with
    # batch norm: it once waited for the others in a collective (the stall
    # timeout) and left an unloadable file. Now it reads no collective, and
    # the file holds the averaged statistics every rank has.
    model = _bn_model()
    model.fit(_scaled_shards(), epochs=1, verbose=0)
    bn = model.layers[1]
    if R == 0:
        path = os.path.join(tempfile.mkdtemp(prefix="perseus-save-r0-"),
                            "m.keras" if KERAS3 else "m")
        start = time.monotonic()
        model.save(path)
        took = time.monotonic() - start
        assert took < 20, f"rank 0's save took {took:.1f} s"
        loaded = keras.models.load_model(path)
        for variable, name in ((bn.moving_mean, "moving_mean"),
                               (bn.moving_variance, "moving_variance")):
            saved = [w for w in loaded.layers[1].weights if name in w.name][0]
            np.testing.assert_allclose(np.asarray(saved.numpy(), np.float64), _local(variable),
                                       rtol=1e-6)
        # (Mirrored variables read locally; predict would be a collective,
        # which rank 0 alone must not run.)
        for a, b in zip(loaded.trainable_weights, model.trainable_weights):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        # get_weights reads locally too (once it was a collective that rank 0
        # alone waited in): the model's and the batch-norm layer's.
        start = time.monotonic()
        got, layer = model.get_weights(), bn.get_weights()
        assert time.monotonic() - start < 20
        np.testing.assert_array_equal(layer[2], np.asarray(_local(bn.moving_mean)))
        for a, b in zip(got, loaded.get_weights()):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=1e-6)
    # Every rank meets here; the averaged statistics are the same everywhere.
    same_on_all_ranks([_local(bn.moving_mean), _local(bn.moving_variance)])


def check_fit_refuses_different_steps_per_epoch_on_every_rank():
    # Datasets of different lengths per rank: named before the first step,
    # not as a dtype mismatch once one rank has run out of data.
    with STRATEGY.scope():
        model = make_model(seed=5)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mine = dataset(64 if R == 0 else 96)
    expect(ValueError, lambda: model.fit(mine, epochs=1, verbose=0),
           "different numbers of steps per epoch", "rank 0: 4", "rank 1: 6",
           "steps_per_epoch=4")
    # Told how many steps, the ranks agree: no false alarm.
    model.fit(mine, epochs=1, steps_per_epoch=4, verbose=0)
    model.fit(mine.repeat(), epochs=1, steps_per_epoch=3, verbose=0)
    same_on_all_ranks([w.numpy() for w in model.weights])
    # Validation data of different lengths: named the same way (once it was
    # "ranks disagree on the dtype"), in fit and in evaluate.
    same = dataset(64)
    expect(ValueError, lambda: model.fit(same, validation_data=mine, epochs=1, verbose=0),
           "fit() validation", "different numbers of evaluation steps", "rank 0: 4",
           "rank 1: 6", "validation_steps=4")
    expect(ValueError, lambda: model.evaluate(mine, verbose=0), "evaluate()", "rank 0: 4",
           "rank 1: 6", "steps=4")
    model.fit(same, validation_data=mine, validation_steps=4, epochs=1, verbose=0)
    model.evaluate(mine, steps=4, verbose=0)
    same_on_all_ranks([w.numpy() for w in model.weights])


def check_predict_returns_every_row_in_order_on_every_rank():
    # Each rank predicts its slice of every global batch; predict once
    # returned only those rows (rows 0-7, 16-23, ... on rank 0), silently.
    # Now every rank gets every row in the input's order, as under
    # MultiWorkerMirroredStrategy: also with a partial last batch, and one
    # of a single row (rank 1's slice of it is empty).
    with STRATEGY.scope():
        model = make_model(seed=5)
    expected = model(X).numpy()
    for n in (64, 61, 3 * GLOBAL_BATCH + 1):
        got = model.predict(X[:n], batch_size=GLOBAL_BATCH, verbose=0)
        assert got.shape == (n, 1), (n, got.shape)
        np.testing.assert_allclose(got, expected[:n], rtol=1e-5, atol=1e-6, err_msg=str(n))
        got = model.predict(dataset(n), verbose=0)
        np.testing.assert_allclose(got, expected[:n], rtol=1e-5, atol=1e-6, err_msg=str(n))
    # A model of two outputs: each gathered, in order.
    inputs = keras.Input((6,))
    with STRATEGY.scope():
        keras.utils.set_random_seed(6)
        two = keras.Model(inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(3)(inputs)])
    first, second = two.predict(X[:40], batch_size=GLOBAL_BATCH, verbose=0)
    want = [t.numpy() for t in two(X[:40])]
    np.testing.assert_allclose(first, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second, want[1], rtol=1e-5, atol=1e-6)
    # predict_on_batch: the batch's rows once each, in order (Keras 3 gives
    # each rank's replica the whole batch: gathered, every row came twice).
    np.testing.assert_allclose(model.predict_on_batch(X[:10]), expected[:10], rtol=1e-5,
                               atol=1e-6)
    # A custom loop: the model under strategy.run, gathered by the strategy.
    dist = STRATEGY.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(X[:48]).batch(GLOBAL_BATCH))
    rows = [STRATEGY.gather(STRATEGY.run(model, (batch,)), axis=0).numpy() for batch in dist]
    np.testing.assert_allclose(np.concatenate(rows), expected[:48], rtol=1e-5, atol=1e-6)
    # Inputs of different lengths: named on every rank before the first
    # batch (rank 1 would otherwise wait in a gather rank 0 never makes).
    expect(ValueError, lambda: model.predict(X[:64 if R == 0 else 96], batch_size=GLOBAL_BATCH,
                                             verbose=0),
           "predict()", "different numbers of steps", "rank 0: 4", "rank 1: 6", "steps=4")
    same_on_all_ranks([model.predict(X[:32], batch_size=GLOBAL_BATCH, verbose=0)])


def check_jit_compile_true_trains_without_xla_after_one_warning():
    # Its reductions have no XLA kernels: once, the first step failed with
    # "Graph execution error". Now fit and evaluate run without XLA.
    import warnings
    with STRATEGY.scope():
        model = make_model(seed=5)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(dataset(64), epochs=1, verbose=0)
        model.evaluate(dataset(64), verbose=0)
    said = [w for w in caught if "Perseus-TF: jit_compile" in str(w.message)]
    # Rank 0 says it, naming Perseus-TF rather than quoting a line of it.
    assert len(said) == (R == 0), [str(w.message) for w in caught]
    assert all("no XLA kernels" in str(w.message) and w.filename == "Perseus-TF"
               for w in said), [(w.filename, str(w.message)) for w in said]
    assert not model.jit_compile
    same_on_all_ranks([w.numpy() for w in model.weights])


class _CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def check_data_of_unknown_length_runs_to_the_longest_rank():
    # Lengths Keras cannot know (a filter): nothing to compare before the
    # first step. tf.distribute gives the rank that runs out first empty
    # batches until every rank has, so every rank runs the longest rank's
    # count of steps (docs/strategy.md says so), with the same weights everywhere.
    with STRATEGY.scope():
        model = make_model(seed=5)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    batches = 4 + (R % 2) * 2  # 4 on even ranks, 6 on odd ones
    mine = dataset(batches * GLOBAL_BATCH).filter(lambda x, y: True)
    count = _CountBatches()
    model.fit(mine, epochs=2, verbose=0, callbacks=[count])
    assert count.batches == 2 * 6, count.batches
    same_on_all_ranks([w.numpy() for w in model.weights])


def check_distributed_datasets_start_no_tf_data_autotuning_thread():
    """TF 2.16+ deletes an iterator that has tf.data's autotuning thread only
    when that thread's sleep ends (up to 60 s: 37 s after 45 s of use, on TF
    2.21): a rank whose garbage collector deletes one stands still while the
    others wait for it in a collective, until GLOO_TIMEOUT_SECONDS fails the
    job. The input pipelines PerseusStrategy distributes, and the per-device
    prefetches tf.distribute builds on them, run without that thread
    (perseus_tf/strategy/input_teardown.py); one that asks for autotuning
    explicitly keeps it."""
    data = tf.data.Dataset.range(64).map(lambda v: v * 2, num_parallel_calls=tf.data.AUTOTUNE)
    iterator = iter(STRATEGY.experimental_distribute_dataset(data.batch(GLOBAL_BATCH)))
    worker = iterator._iterators[0]   # this rank's input pipeline and its devices' prefetches
    assert worker._dataset.options().autotune.enabled is False
    per_device = worker._iterator._device_iterators
    assert per_device, worker
    assert all(d._dataset.options().autotune.enabled is False for d in per_device)
    next(iterator)
    options = tf.data.Options()
    options.autotune.enabled = True
    kept = iter(STRATEGY.experimental_distribute_dataset(
        data.batch(GLOBAL_BATCH).with_options(options)))
    assert kept._iterators[0]._dataset.options().autotune.enabled is True
    next(kept)


def check_sharded_optimizer_state_equals_unsharded():
    """PerseusStrategy(shard_optimizer_state=True) on this Keras (3, or 2:
    TF 2.15's and tf_keras): Adam's weights and slots equal the unsharded
    strategy's, each rank keeps only its own slots, and a saved file loads
    unsharded whole (tests/test_shard.py covers every optimizer and option at
    2 to 4 ranks on the newest Keras 3 and on TF 2.15's Keras 2)."""
    from perseus_tf.strategy import keras_shard
    sharded_strategy = ptf.PerseusStrategy(shard_optimizer_state=True)
    models = []
    for strategy in (STRATEGY, sharded_strategy):
        with strategy.scope():
            model = make_model(seed=0)
            model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.5), loss="mse")
        model.fit(dataset(), epochs=2, verbose=0)
        models.append(model)
    plain, sharded = models
    for a, b in zip(plain.weights, sharded.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=1e-6, err_msg=a.name)
    shapes = [tuple(v.shape) for v in sharded.optimizer.variables]
    # Another rank's slots take no memory here; the largest kernel is split
    # (under clipnorm too: Keras 2 clips a piece by its variable's norm), each
    # rank keeping a piece of its slots.
    pieces = sharded.optimizer._perseus_shards.pieces
    assert (0,) in shapes or pieces, shapes
    assert pieces, pieces
    assert keras_shard.state_bytes(sharded.optimizer) < keras_shard.state_bytes(plain.optimizer)
    path = os.path.join(tempfile.mkdtemp(prefix=f"perseus-shard{R}-"), "m.keras")
    sharded.save(path)  # every rank: the slots are gathered from their owners
    with STRATEGY.scope():
        loaded = keras.models.load_model(path)
    for a, b in zip(loaded.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6, err_msg=b.name)
