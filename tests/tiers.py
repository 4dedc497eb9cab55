"""What runs where: the fast tier (`make check`) and the whole suite in two
TensorFlow versions (`make test`, what CI runs), as jobs for
tools/run_tests.py.

- check: everything that starts no multi-rank TensorFlow job: the C++ unit
  tests, the tree's layout, configuration, the env contracts, the store, the
  launcher's own tests, and the runtime through `_core` at 2 ranks. The loop
  a developer runs before each commit (under 5 minutes from a built tree).
- test, pass "tf2.21" (.venv: TF 2.21, Keras 3): every test file.
- test, pass "tf2.15" (.venv-tf215: TF 2.15, Keras 2, tf.estimator): what
  differs between the versions, not the runtime again. Keras 2 (PerseusStrategy,
  the Horovod shim's Keras layer, BackupAndRestore, the Keras half of the
  model matrix), tf.estimator and TF1 sessions (the Horovod shim), and the op
  library built against TF 2.15 (its kernels, shapes and gradients at 2
  ranks). Files that run the runtime, the launcher or the store without TF,
  and the Bazel build, run in the first pass only: they run the same
  binaries under either version. Inside a file, `second_pass()` picks the
  part of it that the second pass runs.

A job is a test file, or the part of one that a pass runs (pytest -k).
Weights are a job's seconds in a recent `make test` on 2 lanes (the phases
of its timing table): the lanes take the heaviest waiting job first, so the
long ones start early and the short ones fill in.
"""

import os

# Set-up phases of `make test`, in order: (phase name, make target, whether
# it may run beside the first tests). The system packages and the TF 2.21
# venv come first; the CUDA kernels, the TF 2.15 venv, Ray and the other
# Keras releases (tests/keras_versions.py) install while
# the lanes already run first-pass jobs (the jobs that need them wait).
SETUP = [("set-up:system-packages", "system-test", False),
         ("set-up:tf2.21-venv+native", "native", False),
         ("set-up:cuda-wheels", "cuda", True),
         ("set-up:tf2.15-venv+native", "native-old", True),
         ("set-up:ray", "ray", True),
         ("set-up:keras-versions", "keras-versions", True)]

FIRST, SECOND = "tf2.21", "tf2.15"


def second_pass():
    """Whether this pytest process runs the second (TF 2.15) pass."""
    return os.environ.get("PERSEUS_TEST_PASS") == SECOND


class Job:
    """A test file, or the part of it that `select` (pytest -k) picks; it
    starts once the set-up phases it `needs` have passed, and is killed
    after `timeout` seconds (None: run_tests.py's PERSEUS_TEST_JOB_TIMEOUT)."""

    def __init__(self, file, weight, select=None, part=None, needs=(), timeout=None):
        self.file = file
        self.weight = weight
        self.select = select
        self.part = part
        self.name = file + (f"[{part}]" if part else "")
        self.needs = tuple(needs)
        self.timeout = timeout

    def pytest_args(self):
        args = [os.path.join("tests", self.file)]
        if self.select:
            args += ["-k", self.select]
        return args


class Run:
    """A pass: a name, the venv whose Python runs it, its environment, jobs,
    and the set-up phases every job of it needs."""

    def __init__(self, name, venv, env, jobs, needs=()):
        self.name, self.venv, self.env, self.jobs = name, venv, env, jobs
        self.needs = tuple(needs)

    def subset(self, names):
        return Run(self.name, self.venv, self.env,
                   [j for j in self.jobs if j.name in names or j.file in names], self.needs)


def SHARD_JOBS(weight_3_4, weight_2):
    """test_shard.py in two jobs of a pass, each with its own deadline, that
    two lanes can run side by side: 2 ranks (and float16 compression), and 3
    then 4 ranks (one pytest process: the 4-rank launch goes on from the file
    the 3-rank one saved). On a slow machine the whole file ran past the
    1800 s deadline of one job."""
    return [Job("test_shard.py", weight_3_4, select="np3 or np4", part="np3+np4",
                timeout=3600),
            Job("test_shard.py", weight_2, select="np2 or float16", part="np2")]


# The fast tier: no multi-rank TensorFlow job. The runtime's own checks
# through `_core` run at 2 ranks (fused, the simulated device, faults, bounded
# waits, compression on one host, the soak); their 4-rank and two-host
# launches run in `make test`.
CHECK = [Job("test_cc_unit.py", 16), Job("test_layout.py", 2), Job("test_config.py", 12),
         Job("test_contracts.py", 18), Job("test_store_protocol.py", 2),
         Job("test_store_security.py", 16), Job("test_launch_mistakes.py", 6),
         Job("test_runner.py", 39),
         Job("test_core.py", 5, select="2ranks and not 4ranks and not 2hosts"),
         Job("test_faults.py", 20, select="2ranks"),
         Job("test_bounded.py", 10, select="2ranks"),
         Job("test_compression.py", 10, select="1host"),
         Job("test_soak.py", 20, select="2ranks"), Job("test_tiers.py", 3),
         Job("test_gpu.py", 5), Job("test_keras_support.py", 8),
         Job("test_install.py", 3, select="system or one_line"), Job("test_zygote.py", 20)]

# Every file of the first pass, with its weight (seconds).
FIRST_PASS = [
    Job("test_backup_restore.py", 50),
    Job("test_bench.py", 160),
    Job("test_bounded.py", 17),
    Job("test_cc_unit.py", 3),
    Job("test_compression.py", 23),
    Job("test_config.py", 10),
    Job("test_contracts.py", 9),
    Job("test_core.py", 23),
    Job("test_cuda.py", 45, needs=["set-up:cuda-wheels"]),
    Job("test_docs.py", 50),
    Job("test_elastic.py", 70),
    Job("test_examples_and_build.py", 170),
    Job("test_failures.py", 161),
    Job("test_faults.py", 40),
    Job("test_gpu.py", 5),
    Job("test_horovod.py", 100),
    Job("test_horovod_examples.py", 28),
    # README's install recipes in fresh venvs (CPU, and GPU wheels).
    Job("test_install.py", 150),
    # The oldest Keras 3 of each TF release, and tf_keras (tests/keras_versions.py).
    Job("test_keras_support.py", 8),
    Job("test_keras_versions.py", 640, needs=["set-up:keras-versions"]),
    # (Its ranks of two TF versions start one rank in the TF 2.15 venv.)
    Job("test_launch_mistakes.py", 6, needs=["set-up:tf2.15-venv+native"]),
    Job("test_layout.py", 1),
    Job("test_malloc.py", 15),
    Job("test_model_matrix.py", 261),
    Job("test_multihost.py", 158),
    Job("test_operability.py", 15),
    Job("test_ops.py", 22),
    Job("test_preemption.py", 110),
    Job("test_ray.py", 60, needs=["set-up:ray"]),
    Job("test_runner.py", 42),
    *SHARD_JOBS(990, 330),
    Job("test_slurm.py", 36),
    Job("test_soak.py", 83),
    Job("test_store_protocol.py", 1),
    Job("test_store_security.py", 17),
    Job("test_strategy.py", 35),
    Job("test_tiers.py", 1),
    Job("test_zygote.py", 20),
]

# The second pass: the files where the TF version matters (module docstring),
# and in some of them the tests where it does (pytest -k).
SECOND_PASS = [
    # Keras 2's BackupAndRestore, and PerseusStrategy's resume through it.
    Job("test_backup_restore.py", 56),
    # Keras 2's part of elastic fit: a resumed epoch, a worker joining, sharded state.
    Job("test_elastic.py", 40, select="keras"),
    # (Keras 2's part of preemption: the agreed stop and its rerun, and a
    # restart from the last backup; the elastic launcher's own cases, a
    # slot left out, a slot added, none left, are the first pass's.)
    Job("test_preemption.py", 45, select="sigterm or loses_a_rank"),
    # GPU kernels registered by the op library built against TF 2.15 (the
    # CUDA build itself does not depend on TF: first pass).
    Job("test_cuda.py", 3, select="tf_kernels or gpu_tensor", needs=["set-up:cuda-wheels"]),
    # The examples under Keras 2, and one runtime shared by the TF 2.15 op
    # library and _core. (Compression's accuracy, the Bazel build and the
    # Makefile's plan are the runtime's and the build's: first pass.)
    Job("test_examples_and_build.py", 19, select="examples_train or one_runtime_shared"),
    # Failures seen through TF ops, tf.function and Keras fit/save; the
    # runtime's own (through _core) are the first pass's.
    Job("test_failures.py", 51, select="tf or fit or world_size_one or full_checkpoint"),
    # README's quick start under Keras 2 (the site itself: first pass).
    Job("test_docs.py", 25, select="quick_start"),
    # The shim under Keras 2, tf.estimator and TF1 sessions (2-rank launches).
    Job("test_horovod.py", 52),
    Job("test_horovod_examples.py", 33),
    # `import perseus_tf` before TF's first op chooses TF 2.15's allocator too.
    Job("test_config.py", 7),
    # TF 2.15 makes no mallopt call: the fix must leave glibc alone there.
    Job("test_malloc.py", 10),
    # The matrix's Keras half (tests/model_matrix.py SECOND_VERSION).
    Job("test_model_matrix.py", 75),
    # The op library built against TF 2.15 (its 2-rank launch).
    Job("test_ops.py", 7),
    # PerseusStrategy under Keras 2.
    Job("test_strategy.py", 53),
    # Sharded optimizer state under Keras 2 (its own apply_gradients, slots
    # and TensorFlow checkpoints).
    *SHARD_JOBS(850, 250),
    # The supported Keras range found and enforced with Keras 2.
    Job("test_keras_support.py", 8),
    # hvd.init() and the strategy's GPU pinning with TF 2.15's tf.config.
    Job("test_gpu.py", 4, select="real_tensorflow"),
    # Ranks forked after TF 2.15's import (tests/zygote.py serves both passes).
    Job("test_zygote.py", 20),
]


def runs(tier):
    """The passes of a tier, as Runs."""
    if tier == "check":
        return [Run("check", ".venv", {}, CHECK)]
    # make test builds the CUDA kernels: test_cuda.py fails if they are missing.
    return [Run(FIRST, ".venv", {"PERSEUS_TEST_PASS": FIRST, "PERSEUS_REQUIRE_CUDA_WHEELS": "1"},
                FIRST_PASS),
            Run(SECOND, ".venv-tf215", {"PERSEUS_TEST_PASS": SECOND}, SECOND_PASS,
                needs=["set-up:tf2.15-venv+native"])]
