"""Common compile options and thin wrappers used by every BUILD file of the project."""

FSDP_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

def fsdp_cc_library(name, copts = [], **kwargs):
    native.cc_library(name = name, copts = FSDP_COPTS + copts, **kwargs)

def fsdp_cc_binary(name, copts = [], **kwargs):
    native.cc_binary(name = name, copts = FSDP_COPTS + copts, **kwargs)

def fsdp_cc_test(name, copts = [], deps = [], size = "small", **kwargs):
    """A single-process Catch2 test (main in tests/testing/catch_main.cc: JUnit report for Bazel)."""
    native.cc_test(
        name = name,
        size = size,
        copts = FSDP_COPTS + copts,
        deps = deps + ["//tests/testing:catch_main", "//third_party/catch2"],
        **kwargs
    )
