"""Declares @mpi: the system's Open MPI (Debian's libopenmpi-dev), located through `mpicc --showme`."""

def _showme(ctx, what):
    res = ctx.execute(["mpicc", "--showme:" + what])
    if res.return_code != 0:
        fail("@mpi: `mpicc --showme:%s` failed; run tools/setup.sh (installs libopenmpi-dev). %s" % (what, res.stderr))
    return res.stdout.strip().split(" ")

def _mpi_repository_impl(ctx):
    incdirs = [d for d in _showme(ctx, "incdirs") if d]
    libdirs = [d for d in _showme(ctx, "libdirs") if d]
    if not incdirs:
        fail("@mpi: mpicc reports no include folder")
    ctx.symlink(incdirs[0], "include")
    linkopts = []
    for d in libdirs:
        linkopts += ["-L" + d, "-Wl,-rpath," + d]
    linkopts.append("-lmpi")
    ctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "mpi",
    hdrs = glob(["include/**/*.h"]),
    defines = ["OMPI_SKIP_MPICXX"],
    includes = ["include", "include/openmpi"],
    linkopts = {linkopts},
)
""".format(linkopts = repr(linkopts)))

mpi_repository = repository_rule(implementation = _mpi_repository_impl, local = True)

def repo():
    mpi_repository(name = "mpi")
