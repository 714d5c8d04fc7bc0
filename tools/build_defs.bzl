"""Common compile options and thin wrappers used by every BUILD file of the project.

The language level is part of the options (FSDP_CXXOPTS), so the library's targets compile the same
whatever .bazelrc the building workspace has: another workspace using the library (through
local_repository, see third_party/workspace.bzl) needs no --cxxopt. Its own targets that include the
library's headers must compile as C++20 too, e.g.

    load("@fsdp_cpp//tools:build_defs.bzl", "FSDP_CXXOPTS")

    # train.cc: #include "fsdp_cpp/composable/fully_shard.h"

    cc_binary(
        name = "train",
        srcs = ["train.cc"],
        copts = FSDP_CXXOPTS,
        deps = ["@fsdp_cpp//composable:fully_shard"],
    )
"""

# The C++ standard the library (and LibTorch's headers) need. Bazel 4's autoconfigured toolchain
# passes -std=c++0x before copts, so this one wins.
FSDP_CXXOPTS = ["-std=c++20"]

FSDP_COPTS = FSDP_CXXOPTS + [
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

# Every header of the project is included as "fsdp_cpp/<path in this repository>" (e.g.
# "fsdp_cpp/composable/fully_shard.h"), inside the project as in the programs that use it. The
# prefix keeps the project's generic top-level folders (comm/, init/, storage/, ...) from colliding
# with a monorepo's own: without it, `#include "comm/init.h"` inside the library could resolve to
# another workspace's comm/init.h, depending only on the order of the include paths. Bazel serves
# the prefixed path from the declaring target's hdrs (bazel-bin/<package>/_virtual_includes/), so a
# header is reachable only through a target that declares it.
FSDP_INCLUDE_PREFIX = "fsdp_cpp"

def fsdp_cc_library(name, copts = [], **kwargs):
    # Bazel replaces the package path by include_prefix (the package is stripped when only the
    # prefix is set), so the prefix names the package too.
    native.cc_library(
        name = name,
        copts = FSDP_COPTS + copts,
        include_prefix = FSDP_INCLUDE_PREFIX + "/" + native.package_name(),
        **kwargs
    )

def fsdp_cc_binary(name, copts = [], **kwargs):
    native.cc_binary(name = name, copts = FSDP_COPTS + copts, **kwargs)

def fsdp_cc_test(name, copts = [], deps = [], size = "small", timeout = "moderate", **kwargs):
    """A single-process Catch2 test (main in tests/testing/catch_main.cc: JUnit report for Bazel)."""
    native.cc_test(
        name = name,
        size = size,
        # Small in resources, but a moderate (300 s) timeout: each binary loads LibTorch, and while
        # `bazel test //...` compiles beside it on a 2-core machine a sub-second test overran the
        # 60 s of a small test once.
        timeout = timeout,
        copts = FSDP_COPTS + copts,
        # Labels, not strings: they name this repository's targets whichever workspace calls the macro.
        deps = deps + [Label("//tests/testing:catch_main"), Label("//third_party/catch2")],
        **kwargs
    )
