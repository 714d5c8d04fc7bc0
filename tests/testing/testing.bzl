"""fsdp_mpi_test: a Catch2 test binary run on several world sizes over MPI, one mpirun per size."""

load("//tools:build_defs.bzl", "fsdp_cc_binary")

def fsdp_mpi_test(name, srcs, deps = [], world_sizes = [1, 2, 3, 4], args = [], size = "medium", tags = [], **kwargs):
    binary = name + "_bin"
    fsdp_cc_binary(
        name = binary,
        srcs = srcs,
        deps = deps + ["//tests/testing:mpi_test_main"],
        testonly = True,
    )
    native.sh_test(
        name = name,
        srcs = ["//tests/testing:run_mpi_test.sh"],
        data = [":" + binary, "//tests/testing:merge_junit.py"],
        args = ["$(location :%s)" % binary, ",".join([str(n) for n in world_sizes])] + args,
        size = size,
        # Never two multi-rank launches at once on a 2-core machine.
        tags = tags + ["exclusive", "mpi"],
        **kwargs
    )
