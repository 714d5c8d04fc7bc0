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

# The options the precompiled header (//tools/pch:torch_pch) is built with. The configuration's own
# flags (compilation mode, --copt, sanitizers, -fPIC) are added by the rule, as for any compile.
FSDP_PCH_COPTS = FSDP_COPTS

# What an fsdp_cc_* target that uses LibTorch adds: the precompiled LibTorch headers forced in
# first, and a warning whenever GCC cannot use them (tools/pch/pch.bzl). `pch` defaults to whether
# the target lists a @libtorch target among its deps: a target that does not use LibTorch keeps its
# translation units as they are (LibTorch's headers would change them: c10 declares an operator<<
# for every std::vector, which Catch2 then picks to print vectors of types without one).
# The header is forced in by its path in the output tree, which both compilers need: GCC takes the
# .gch beside the header it includes, Clang's driver the .pch beside the path -include names (it does
# not search the include path for it). $(BINDIR) is the configuration's output folder; the
# repository's root is empty here and external/<name> in a workspace that uses the library.
_PCH_LABEL = Label("//tools/pch:torch_pch")
_PCH_PATH = "/".join([p for p in ["$(BINDIR)", _PCH_LABEL.workspace_root, _PCH_LABEL.package, _PCH_LABEL.name, "fsdp_cpp_torch_pch.h"] if p])
_PCH_COPTS = ["-Winvalid-pch", "-include", _PCH_PATH]
_PCH_DEPS = [_PCH_LABEL]

def _uses_libtorch(deps):
    for dep in deps:
        if type(dep) == "string" and dep.startswith("@libtorch//"):
            return True
    return False

def _pch(pch, copts, deps):
    if pch == None:
        pch = _uses_libtorch(deps)
    if not pch:
        return FSDP_COPTS + copts, deps

    # `--define=fsdp_pch=off` compiles every file as written (a check that each includes what it
    # uses, or a compile-time comparison).
    off = str(Label("//tools/pch:off"))
    return (
        FSDP_COPTS + select({off: [], "//conditions:default": _PCH_COPTS}) + copts,
        deps + select({off: [], "//conditions:default": _PCH_DEPS}),
    )

# Every header of the project is included as "fsdp_cpp/<path in this repository>" (e.g.
# "fsdp_cpp/composable/fully_shard.h"), inside the project as in the programs that use it. The
# prefix keeps the project's generic top-level folders (comm/, init/, storage/, ...) from colliding
# with a monorepo's own: without it, `#include "comm/init.h"` inside the library could resolve to
# another workspace's comm/init.h, depending only on the order of the include paths. Bazel serves
# the prefixed path from the declaring target's hdrs (bazel-bin/<package>/_virtual_includes/), so a
# header is reachable only through a target that declares it.
FSDP_INCLUDE_PREFIX = "fsdp_cpp"

def fsdp_cc_library(name, copts = [], deps = [], pch = None, **kwargs):
    copts, deps = _pch(pch, copts, deps)

    # Bazel replaces the package path by include_prefix (the package is stripped when only the
    # prefix is set), so the prefix names the package too.
    native.cc_library(
        name = name,
        copts = copts,
        deps = deps,
        include_prefix = FSDP_INCLUDE_PREFIX + "/" + native.package_name(),
        **kwargs
    )

def fsdp_cc_binary(name, copts = [], deps = [], pch = None, **kwargs):
    copts, deps = _pch(pch, copts, deps)
    native.cc_binary(name = name, copts = copts, deps = deps, **kwargs)

def fsdp_cc_test(name, copts = [], deps = [], size = "small", timeout = "moderate", pch = None, **kwargs):
    """A single-process Catch2 test (main in tests/testing/catch_main.cc: JUnit report for Bazel)."""
    native.cc_test(
        name = name,
        size = size,
        # Small in resources, but a moderate (300 s) timeout: each binary loads LibTorch, and while
        # `bazel test //...` compiles beside it on a 2-core machine a sub-second test overran the
        # 60 s of a small test once.
        timeout = timeout,
        copts = _pch(pch, copts, deps)[0],
        # Labels, not strings: they name this repository's targets whichever workspace calls the macro.
        deps = _pch(pch, copts, deps)[1] + [Label("//tests/testing:catch_main"), Label("//third_party/catch2")],
        **kwargs
    )
