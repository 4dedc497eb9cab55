"""Real models trained on every rank, checked against one process.

    model_matrix_worker.py OUT_JSON ITEM [ITEM ...]

An ITEM is MODEL:ENTRY, ENTRY being `fit` (Keras fit under PerseusStrategy)
or `tape` (a custom loop with the Horovod shim's DistributedGradientTape).
The settings (PERSEUS_* variables) are the launch's environment; the
accumulation and mixed-precision settings are read from it too.

For each item every rank trains the model on the same global batches (each
rank takes its contiguous slice of every global batch, as tf.distribute
shards a batched dataset), then:
  - the ranks compare their trainable weights (gathered to rank 0): they
    must be identical;
  - rank 0 trains the same model in this one process with
    tf.distribute.MirroredStrategy over one logical CPU per rank (so batch
    normalisation sees the same per-replica batches) on the same global
    batches; with compression off its weights must equal the ranks' to
    1e-5.
Rank 0 writes {item: "ok" | failure text, item + ":seconds": s} to OUT_JSON.
"""

import json
import os
import sys
import time
import traceback

import numpy as np

SIZE = int(os.environ.get("PERSEUS_SIZE", "1"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

# One logical CPU per rank for the single-process reference, configured
# before TensorFlow starts its devices. PerseusStrategy itself uses /cpu:0.
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(max(SIZE, 1))])

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import perseus_tf  # noqa: E402
import perseus_tf.horovod as hvd  # noqa: E402

keras = tf.keras
PER_RANK_BATCH = 8
STEPS = 6          # two epochs of three steps: enough to enter an offline plan
LR = 0.01
ACCUM = int(os.environ.get("PERSEUS_ACCUMULATE_N_STEPS", "1"))
MIXED = os.environ.get("MATRIX_MIXED_PRECISION") == "1"
EXACT = (os.environ.get("PERSEUS_ALLREDUCE_DTYPE") == "1"
         and os.environ.get("PERSEUS_TOPK_ALLREDUCE", "0") == "0")
TOLERANCE = 1e-5
VOCAB, SEQ = 200, 12


# -- models ------------------------------------------------------------------------

def tutorial_cnn():
    # TF's "Multi-worker training with Keras" tutorial model.
    return keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def mobilenet_v2():
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10,
                                          classifier_activation=None)


def transformer():
    tokens = keras.Input(shape=(SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 32)(tokens)
    attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
    x = keras.layers.LayerNormalization()(x + attn)
    ff = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(32)(ff))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(10)(x))


def lstm():
    tokens = keras.Input(shape=(SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 16)(tokens)
    x = keras.layers.LSTM(24)(x)
    return keras.Model(tokens, keras.layers.Dense(10)(x))


def embedding():
    # Embedding gradients arrive as tf.IndexedSlices.
    tokens = keras.Input(shape=(SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB * 5, 24)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(10)(x))


class WithUnused(keras.Model):
    """A frozen layer, and a trainable layer the loss never reaches (its
    variables get no gradient)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.frozen = keras.layers.Dense(32, activation="relu")
        self.frozen.trainable = False
        self.head = keras.layers.Dense(10)
        self.unused = keras.layers.Dense(7)

    def build(self, input_shape):
        self.frozen.build(input_shape)
        self.head.build((input_shape[0], 32))
        self.unused.build(input_shape)
        self.built = True

    def call(self, x):
        return self.head(self.frozen(x))


def frozen():
    model = WithUnused(name="with_unused")
    model.build((None, 20))
    return model


def two_outputs():
    x_in = keras.Input(shape=(20,))
    h = keras.layers.Dense(32, activation="relu")(x_in)
    a = keras.layers.Dense(10, name="a")(h)
    b = keras.layers.Dense(1, name="b")(h)
    return keras.Model(x_in, [a, b])


MODELS = {"cnn": tutorial_cnn, "mobilenet": mobilenet_v2, "transformer": transformer,
          "lstm": lstm, "embedding": embedding, "frozen": frozen, "two_outputs": two_outputs}
BATCH_NORM = {"mobilenet"}


def global_data(name, n):
    rng = np.random.default_rng(7)
    if name == "cnn":
        x = rng.random((n, 28, 28), np.float32)
    elif name == "mobilenet":
        x = rng.random((n, 32, 32, 3), np.float32)
    elif name in ("transformer", "lstm", "embedding"):
        x = rng.integers(0, VOCAB * (5 if name == "embedding" else 1), (n, SEQ)).astype(np.int32)
    else:
        x = rng.random((n, 20), np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    if name == "two_outputs":
        return x, (y, rng.random((n, 1), np.float32))
    return x, y


def losses(name):
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "two_outputs":
        return [ce, keras.losses.MeanSquaredError()], [1.0, 0.5]
    return ce, None


def compile_model(model, name):
    loss, weights = losses(name)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss, loss_weights=weights)


# -- training ------------------------------------------------------------------------

def batches(name, size):
    """Global batches (STEPS of them) and the dataset of them."""
    gb = PER_RANK_BATCH * size
    x, y = global_data(name, gb * STEPS)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(gb), x, y, gb


def train_fit(strategy, name, initial, size):
    ds = batches(name, size)[0]
    with strategy.scope():
        model = MODELS[name]()
        model.set_weights(initial)
        compile_model(model, name)
    model.fit(ds, epochs=2, steps_per_epoch=STEPS // 2, verbose=0)
    return model


def train_tape(name, initial):
    _, x, y, gb = batches(name, hvd.size())
    model = MODELS[name]()
    model.set_weights(initial)
    loss_fn, weights = losses(name)
    opt = keras.optimizers.SGD(LR)
    r = hvd.rank()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            out = model(xb, training=True)
            if name == "two_outputs":
                loss = loss_fn[0](yb[0], out[0]) * weights[0] + loss_fn[1](yb[1], out[1]) * weights[1]
            else:
                loss = loss_fn(yb, out)
        tape = hvd.DistributedGradientTape(tape)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return loss

    for s in range(STEPS):
        lo, hi = s * gb + r * PER_RANK_BATCH, s * gb + (r + 1) * PER_RANK_BATCH
        yb = (y[0][lo:hi], y[1][lo:hi]) if name == "two_outputs" else y[lo:hi]
        step(x[lo:hi], yb)
    return model


def reference(name, initial, size, entry):
    """The same training in one process: MirroredStrategy over `size`
    logical CPUs, the same global batches (accumulation: N of them make one
    update, so the reference batch is N times larger)."""
    devices = [f"/cpu:{i}" for i in range(size)]
    # Keras 3.0 to 3.7 do not average gradients under any strategy (3.0 to
    # 3.4 never reduce them, 3.5 to 3.7 sum them unscaled); PerseusStrategy
    # trains as Keras 3.8 does there (keras_backports), so the reference
    # must too. (checks_strategy.py compares those releases with training
    # under no strategy at all.)
    from perseus_tf import patches
    from perseus_tf.strategy import keras_backports

    def mirrored(s):
        return isinstance(s, tf.distribute.MirroredStrategy)

    keras_backports.also_under(mirrored)
    patches.install(patches.BACKPORTS)
    # Reduced on one device: no collective ops, whose keys a second
    # MirroredStrategy in one process would reuse.
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    accum = ACCUM if entry == "fit" else 1
    gb = PER_RANK_BATCH * size
    x, y = global_data(name, gb * STEPS)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(gb * accum)
    with strategy.scope():
        model = MODELS[name]()
        model.set_weights(initial)
        compile_model(model, name)
    model.fit(ds, epochs=1, steps_per_epoch=STEPS // accum, verbose=0)
    return [v.numpy() for v in model.trainable_variables]


def run_item(item, strategy):
    name, entry = item.split(":")
    # Collectives inside a tf.function are paired by op name, which holds
    # Keras' object names (sgd_2, ...): every rank starts each item from the
    # same naming state, although rank 0 alone built reference models.
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    initial = MODELS[name]().get_weights()
    size = hvd.size()
    model = train_fit(strategy, name, initial, size) if entry == "fit" else train_tape(name, initial)
    mine = [np.asarray(v.numpy(), np.float32) for v in model.trainable_variables]
    # Every rank's weights, gathered to compare them on rank 0.
    flat = np.concatenate([w.ravel() for w in mine]) if mine else np.zeros(0, np.float32)
    everyone = hvd.allgather(tf.constant(flat[None, :])).numpy()
    if hvd.rank() != 0:
        return None
    problems = []
    for r in range(1, size):
        if not np.array_equal(everyone[r], everyone[0]):
            worst = float(np.max(np.abs(everyone[r] - everyone[0])))
            problems.append(f"rank {r}'s trainable weights differ from rank 0's (max {worst:g})")
    if not np.all(np.isfinite(flat)):
        problems.append("weights hold NaN/Inf")
    if EXACT:
        want = reference(name, initial, size, entry)
        for v, got, ref in zip(model.trainable_variables, mine, want):
            if not np.allclose(got, ref, rtol=TOLERANCE, atol=TOLERANCE):
                problems.append(f"{v.name}: differs from one process by "
                                f"{float(np.max(np.abs(got - ref))):g} (> {TOLERANCE})")
                break
        moved = any(not np.array_equal(got, init) for got, init in
                    zip(mine, [w for w, v in zip(initial, model.weights) if v.trainable]))
        if not moved:
            problems.append("training did not change the weights")
    return "ok" if not problems else "; ".join(problems)


def main():
    out_path, items = sys.argv[1], sys.argv[2:]
    if MIXED:
        keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = perseus_tf.PerseusStrategy()
    hvd.init()
    results = {}
    for item in items:
        start = time.time()
        try:
            outcome = run_item(item, strategy)
        except Exception:  # noqa: BLE001 - reported per item
            outcome = traceback.format_exc()[-2000:]
        if hvd.rank() == 0:
            results[item] = outcome
            results[item + ":seconds"] = round(time.time() - start, 1)
            print(f"MATRIX {item}: {'ok' if outcome == 'ok' else 'FAILED'} "
                  f"({time.time() - start:.1f} s)", flush=True)
            if outcome != "ok":
                print(outcome, flush=True)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
