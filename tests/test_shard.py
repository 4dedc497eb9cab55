"""Sharded optimizer state (perseus_tf/strategy/keras_shard.py) against the
unsharded PerseusStrategy in the same processes, at 2, 3 and 4 ranks
(tests/workers/checks_shard.py): every Keras optimizer, schedules, clipping,
mixed precision, accumulation, saving both ways and at another world size,
refusals, and the Horovod shim's DistributedOptimizer against its own
allreduce; and float16 compression at 2. Both passes of `make test` run them:
Keras 3 (TF 2.21) and Keras 2 (TF 2.15, where TensorFlow checkpoints are
checked too); tf_keras runs checks_strategy's
check_sharded_optimizer_state_equals_unsharded (tests/test_keras_versions.py).

Keras 3 runs every check at every world size. Keras 2 runs every check at 2
and 3 ranks and, at 4, the checks of checks_shard.KERAS2_AT_4_RANKS: where 4
ranks place, split, clip, skip or save differently from 2 and 3 (its code
for optimizers and options is the same at any size, and Keras 3 runs them at
4). tests/tiers.py runs 2 ranks and 3-then-4 as two jobs (ids np2, np3 and
np4: `-k np2`); a world size goes on from the file the one before it in the
same pytest process saved.

Offline plans are off in these launches: a step that mixed precision skips
makes the unsharded run's plan wait out its 10 s before it falls back to
online negotiation (the sharded reduce-scatter never runs from a plan)."""

import pytest

from harness import check_names, four_rank_checks, launch_report, run_checks
from tiers import second_pass

CHECKS = check_names("checks_shard")
FP16 = "check_float16_compression_as_unsharded"
ENV = {"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_OFFLINE_NEG": "0"}
SIZES = (2, 3, 4)


def checks_at(np_):
    """The checks a launch of np_ ranks runs in this pass."""
    names = [c for c in CHECKS if c != FP16]
    if np_ == 4 and second_pass():
        keep = set(four_rank_checks("checks_shard", "KERAS2_AT_4_RANKS"))
        names = [c for c in names if c in keep]
    return names


@pytest.fixture(scope="module")

def files(tmp_path_factory):
    # Each world size saves here and goes on from the previous one's file.
    return str(tmp_path_factory.mktemp("shard-files"))


@pytest.fixture(scope="module")

def launches(files):
    # One launch per world size, whichever test asks first (in id order: 2,
    # 3, then 4, each going on from the file the one before saved).
    made = {}

    def launch(np_):
        if np_ not in made:
            made[np_] = run_checks("checks_shard", np_, timeout=2400, names=checks_at(np_),
                                   env=dict(ENV, PERSEUS_TEST_SHARD_FILES=files))
        return made[np_]
    return launch


@pytest.fixture

def launched(request, launches):
    return launches(request.param)


@pytest.mark.parametrize("launched,check",
                         [pytest.param(n, c, id=f"np{n}-{c}") for n in SIZES for c in checks_at(n)],
                         indirect=["launched"])

def test_shard(launched, check):
    launched.assert_ok(check)


@pytest.mark.parametrize("launched", SIZES, ids=[f"np{n}" for n in SIZES], indirect=True)

def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launch_report(launched.proc)


def test_float16_compression_at_2_ranks():
    launched = run_checks("checks_shard", 2, timeout=600, names=[FP16],
                          env=dict(ENV, PERSEUS_ALLREDUCE_DTYPE="0"))
    launched.assert_ok(FP16)
    assert launched.proc.returncode == 0, launch_report(launched.proc)
