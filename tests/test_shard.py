"""Sharded optimizer state (perseus_tf/strategy/keras_shard.py) against the
unsharded PerseusStrategy in the same processes, at 2, 3 and 4 ranks
(tests/workers/checks_shard.py): every Keras optimizer, schedules, clipping,
mixed precision, accumulation, saving both ways and at another world size,
refusals, and the Horovod shim's DistributedOptimizer against its own
allreduce; and float16 compression at 2. Both passes of `make test` run them:
Keras 3 (TF 2.21) and Keras 2 (TF 2.15, where TensorFlow checkpoints are
checked too); tf_keras runs checks_strategy's
check_sharded_optimizer_state_equals_unsharded (tests/test_keras_versions.py).

Offline plans are off in these launches: a step that mixed precision skips
makes the unsharded run's plan wait out its 10 s before it falls back to
online negotiation (the sharded reduce-scatter never runs from a plan)."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_shard")
FP16 = "check_float16_compression_as_unsharded"
ENV = {"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_OFFLINE_NEG": "0"}


@pytest.fixture(scope="module")

def files(tmp_path_factory):
    # Each world size saves here and goes on from the previous one's file.
    return str(tmp_path_factory.mktemp("shard-files"))


@pytest.fixture(scope="module", params=[2, 3, 4])

def launched(request, files):
    return run_checks("checks_shard", request.param, timeout=900,
                      names=[c for c in CHECKS if c != FP16],
                      env=dict(ENV, PERSEUS_TEST_SHARD_FILES=files))


@pytest.mark.parametrize("check", [c for c in CHECKS if c != FP16])

def test_shard(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]


def test_float16_compression_at_2_ranks():
    launched = run_checks("checks_shard", 2, timeout=600, names=[FP16],
                          env=dict(ENV, PERSEUS_ALLREDUCE_DTYPE="0"))
    launched.assert_ok(FP16)
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
