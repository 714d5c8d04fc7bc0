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
    """A single-process test with Catch2's own main()."""
    native.cc_test(
        name = name,
        size = size,
        copts = FSDP_COPTS + copts,
        deps = deps + ["//third_party/catch2:catch2_main"],
        **kwargs
    )
