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
    "cc/runtime/negotiation_plan.cc",
    "cc/runtime/fusion.cc",
    "cc/runtime/plan.cc",
    "cc/runtime/plan_check.cc",
    "cc/runtime/request_table.cc",
    "cc/runtime/request_table_plan.cc",
    "cc/transport/allreduce_algorithms.cc",
    "cc/device/sim_device.cc",
    "cc/transport/nccl.cc",
]

UNIT_MAIN = "cc/testing/main.cc"

# Unit tests that need Gloo (-lgloo): each a binary of its own, with the
# library sources it tests.
GLOO_UNIT_TESTS = {
    "cc/transport/gloo_abortable_test.cc": ["cc/transport/gloo_abortable.cc"],
}

# The fake libnccl.so.2 the NCCL unit tests load (PERSEUS_TEST_FAKE_NCCL).
FAKE_NCCL = "cc/testing/fake_nccl.cc"
