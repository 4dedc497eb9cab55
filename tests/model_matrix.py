"""The real-model test matrix: which settings, models and entry points run.

A launch is (ranks, settings, items); settings become PERSEUS_* variables,
items are MODEL:ENTRY pairs run one after another in that launch by
tests/workers/model_matrix_worker.py (ENTRY: `fit` under PerseusStrategy,
`tape` a custom loop with the Horovod shim's DistributedGradientTape).

FACTORS lists every value of every setting. CI runs PAIRWISE: every pair of
setting values appears in some launch, every model with every entry point,
every model at 2 and 4 ranks, and under both exact and compressed settings;
the tutorial CNN and MobileNetV2 run with defaults (every setting "auto")
at 2 ranks; the 4-rank launches of the cover hold both models too.
`python tools/model_matrix.py --full` runs the whole product.

Constraints (so that "equals one process" is a meaningful check):
accumulation applies to `fit` only and is not paired with batch-norm models
(an N-times larger batch changes batch statistics); mixed precision runs
with `fit` (Keras' LossScaleOptimizer).
"""

import itertools

MODELS = ["cnn", "mobilenet", "transformer", "lstm", "embedding", "frozen", "two_outputs"]
ENTRIES = ["fit", "tape"]
FACTORS = {
    "np": ["2", "4"],
    # "auto" (the default of both) runs in the two launches of defaults and
    # in nearly every other test; the cover pairs the forced values.
    "offline_neg": ["0", "1"],
    "fusion": ["0", "1"],
    "streams": ["1", "4"],
    "compression": ["none", "fp16", "mixed", "topk"],
    "accumulate": ["1", "2"],
    "mixed_precision": ["0", "1"],
}


def env_for(settings):
    """PERSEUS_* variables for a settings dict (missing keys: defaults)."""
    env = {}
    s = dict(settings)
    if s.get("offline_neg", "auto") != "auto":
        env["PERSEUS_OFFLINE_NEG"] = s["offline_neg"]
    if s.get("fusion", "auto") != "auto":
        env["PERSEUS_ALLREDUCE_FUSION"] = s["fusion"]
    if s.get("streams", "auto") != "auto":
        env["PERSEUS_ALLREDUCE_STREAMS"] = s["streams"]
    compression = s.get("compression", "default")
    if compression == "none":
        env["PERSEUS_ALLREDUCE_DTYPE"] = "1"
    elif compression == "fp16":
        env["PERSEUS_ALLREDUCE_DTYPE"] = "0"
    elif compression == "mixed":
        env["PERSEUS_ALLREDUCE_DTYPE"] = "2"
    elif compression == "topk":
        env["PERSEUS_TOPK_ALLREDUCE"] = "1"
        env["PERSEUS_ALLREDUCE_DTYPE"] = "1"
    if s.get("accumulate", "1") != "1":
        env["PERSEUS_ACCUMULATE_N_STEPS"] = s["accumulate"]
    if s.get("mixed_precision", "0") == "1":
        env["MATRIX_MIXED_PRECISION"] = "1"
    return env


def _pairs(settings):
    return set(itertools.combinations(sorted(settings.items()), 2))


def _cover():
    """Launches whose settings hold every pair of factor values (greedy: each
    next launch is the combination covering most pairs not yet covered; ties
    to the first in product order, so the cover is the same every run)."""
    keys = sorted(FACTORS)
    candidates = [dict(zip(keys, v)) for v in itertools.product(*(FACTORS[k] for k in keys))]
    uncovered = set()
    for c in candidates:
        uncovered |= _pairs(c)
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda c: len(_pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def _pairwise():
    """The cover, plus the defaults at 2 ranks, with items dealt so that
    every model meets both entry points and both rank counts."""
    launches = [(2, {}, ["cnn:fit", "mobilenet:fit"])]
    wanted = [f"{m}:{e}" for m in MODELS for e in ENTRIES]
    seen = set()
    for i, settings in enumerate(_cover()):
        np_ = int(settings.pop("np"))
        items = []
        # Items not yet run at this rank count first, then the least used.
        order = sorted(wanted, key=lambda it: ((it, np_) in seen, sum(
            1 for s in seen if s[0] == it), (wanted.index(it) + 5 * i) % len(wanted)))
        for it in order:
            heavy = it.startswith("mobilenet")
            if allowed(it, settings) and len(items) < 2 and not (heavy and np_ == 4 and items):
                items.append(it)
                seen.add((it, np_))
        launches.append((np_, settings, items))
    return launches


def launch_id(launch):
    np_, settings, _ = launch
    return f"{np_}ranks-" + "-".join(f"{k}={v}" for k, v in sorted(settings.items())) \
        if settings else f"{np_}ranks-defaults"


def allowed(item, settings):
    """Whether an item's check is meaningful under these settings."""
    model, entry = item.split(":")
    if settings.get("accumulate", "1") != "1" and (entry != "fit" or model == "mobilenet"):
        return False
    if settings.get("mixed_precision", "0") == "1" and entry != "fit":
        return False
    return True


PAIRWISE = None  # filled below


def full():
    """Every combination of settings, with every item each allows."""
    keys = sorted(FACTORS)
    items = [f"{m}:{e}" for m in MODELS for e in ENTRIES]
    for values in itertools.product(*(FACTORS[k] for k in keys)):
        settings = dict(zip(keys, values))
        np_ = int(settings.pop("np"))
        yield np_, settings, [i for i in items if allowed(i, settings)]


def _second_version():
    """The launches of PAIRWISE a second TF version runs (the TF 2.15 pass of
    `make test`, tests/tiers.py): what differs between TF versions is Keras and
    tf.distribute, not the runtime, so every model and both entry points run
    there (not every pairing of the two: the custom loop's Keras 2 side, the
    shim's tape and optimizer, is tests/test_horovod.py's second pass), and
    every value of the settings Keras takes part in (compression,
    accumulation, mixed precision) and both rank counts appear; the
    runtime's own pairs are covered by the first version. Greedy, so the
    same launches every run."""
    def needs(launch):
        np_, settings, items = launch
        out = {("model", it.split(":")[0]) for it in items} | \
            {("entry", it.split(":")[1]) for it in items} | {("np", np_)}
        for key in ("compression", "accumulate", "mixed_precision"):
            out.add((key, settings.get(key, "default")))
        return out
    uncovered = set().union(*(needs(l) for l in PAIRWISE))
    chosen = []
    while uncovered:
        best = max(PAIRWISE, key=lambda l: len(needs(l) & uncovered))
        chosen.append(best)
        uncovered -= needs(best)
    return [l for l in PAIRWISE if l in chosen]


PAIRWISE = _pairwise()
SECOND_VERSION = _second_version()
