"""Re-exports of Bazel's native C/C++ rules under the rules_cc names.

Only what Bazel 4.2.3 (and a normal C++ BUILD file) loads from
@rules_cc//cc:defs.bzl is provided.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
