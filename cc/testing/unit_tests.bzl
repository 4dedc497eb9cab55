# The C++ unit tests (cc/**/*_test.cc, written with cc/testing/check.h) and the
# library sources they link. One list, read by BUILD (the test binaries that
# `bazel build //:cc_unit //:gloo_abortable_test` compiles) and by
# tests/test_cc_unit.py (g++, cached under build/cc-unit/). Plain string
# literals only: the test reads this file with Python's ast.

# What every unit test binary links besides the *_test.cc files themselves
# (no Gloo, no TensorFlow, no GPU).
UNIT_LIBRARY_SOURCES = [
    "cc/core/common.cc",
    "cc/core/reduce.cc",
    "cc/core/shared_library.cc",
    "cc/core/timeline.cc",
    "cc/runtime/message.cc",
    "cc/runtime/negotiation.cc",
    "cc/runtime/plan/learner.cc",
    "cc/runtime/plan/envelope.cc",
    "cc/runtime/plan/state.cc",
    "cc/runtime/plan/check.cc",
    "cc/runtime/request_table.cc",
    "cc/runtime/plan/request_table_plan.cc",
    "cc/transport/allreduce_algorithms.cc",
    "cc/transport/cost_model.cc",
    "cc/device/sim_device.cc",
    "cc/transport/nccl.cc",
    # The executor and what it runs (cc/runtime/executor_test.cc).
    "cc/runtime/executor.cc",
    "cc/runtime/executor_nccl.cc",
    "cc/runtime/collectives.cc",
    "cc/runtime/staging.cc",
    "cc/runtime/fused_allreduce.cc",
    "cc/runtime/compression/compressors.cc",
    "cc/runtime/compression/downsample.cc",
    "cc/runtime/compression/fp16.cc",
    "cc/runtime/compression/topk.cc",
    "cc/device/host_plane.cc",
    "cc/device/sim_plane.cc",
    "cc/device/cuda_library.cc",
]

UNIT_MAIN = "cc/testing/main.cc"

# Unit tests that need Gloo (-lgloo): each a binary of its own, with the
# library sources it tests. The controller's and the health monitor's reach
# Gloo through the store client (gloo::rendezvous::Store is its base).
GLOO_UNIT_TESTS = {
    "cc/transport/gloo_abortable_test.cc": ["cc/transport/gloo_abortable.cc"],
    # GlooTransport's own algorithms (recursive doubling, Bruck's allgather,
    # the reduce-scatter ring) and the cost model's measurement over them.
    "cc/transport/gloo_transport_test.cc": [
        "cc/core/common.cc",
        "cc/core/reduce.cc",
        "cc/transport/cost_model.cc",
        "cc/transport/gloo_abort.cc",
        "cc/transport/gloo_abortable.cc",
        "cc/transport/gloo_transport.cc",
    ],
    # The health monitor over a store in memory (its StoreClient adapter
    # reaches Gloo's Store base class).
    "cc/runtime/health_test.cc": [
        "cc/core/common.cc",
        "cc/rendezvous/hmac_sha256.cc",
        "cc/rendezvous/store_client.cc",
        "cc/runtime/health.cc",
    ],
    "cc/runtime/controller_test.cc": [
        "cc/core/common.cc",
        "cc/core/reduce.cc",
        "cc/core/shared_library.cc",
        "cc/core/timeline.cc",
        "cc/rendezvous/hmac_sha256.cc",
        "cc/rendezvous/store_client.cc",
        "cc/transport/allreduce_algorithms.cc",
        "cc/transport/cost_model.cc",
        "cc/transport/gloo_abortable.cc",
        "cc/transport/nccl.cc",
        "cc/device/cuda_library.cc",
        "cc/device/host_plane.cc",
        "cc/device/sim_device.cc",
        "cc/device/sim_plane.cc",
        "cc/runtime/collectives.cc",
        "cc/runtime/compression/compressors.cc",
        "cc/runtime/compression/downsample.cc",
        "cc/runtime/compression/fp16.cc",
        "cc/runtime/compression/topk.cc",
        "cc/runtime/controller.cc",
        "cc/runtime/executor.cc",
        "cc/runtime/executor_nccl.cc",
        "cc/runtime/faults.cc",
        "cc/runtime/fused_allreduce.cc",
        "cc/runtime/plan/envelope.cc",
        "cc/runtime/health.cc",
        "cc/runtime/message.cc",
        "cc/runtime/negotiation.cc",
        "cc/runtime/plan/learner.cc",
        "cc/runtime/plan/offline.cc",
        "cc/runtime/plan/state.cc",
        "cc/runtime/plan/check.cc",
        "cc/runtime/request_table.cc",
        "cc/runtime/plan/request_table_plan.cc",
        "cc/runtime/staging.cc",
    ],
}

# The fake libnccl.so.2 the NCCL unit tests load (PERSEUS_TEST_FAKE_NCCL).
FAKE_NCCL = "cc/testing/fake_nccl.cc"
