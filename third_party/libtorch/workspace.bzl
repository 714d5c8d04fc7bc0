"""Declares @libtorch: LibTorch from LIBTORCH_HOME (an official LibTorch zip) or, when that is unset,
from the torch package of the project's Python (PYTHON_BIN_PATH, else tools/setup.sh's environment
~/.cache/fsdp_cpp/venv, else `python3` on PATH; tools/setup.sh installs the pinned one).

Libraries are linked by -L/-l with an absolute rpath to the real lib folder, so each library's own
$ORIGIN rpath (the torch wheel's way of finding the nvidia-* runtime wheels) keeps working."""

load("//third_party/python:workspace.bzl", "project_python")

_CUDA_INCLUDE_CANDIDATES = [
    "../nvidia/cu13/include",  # torch wheels built for CUDA 13
    "../nvidia/cuda_runtime/include",  # torch wheels built for CUDA 12
]

_CUDART_LIB_CANDIDATES = [
    "../nvidia/cu13/lib",  # torch wheels built for CUDA 13
    "../nvidia/cuda_runtime/lib",  # torch wheels built for CUDA 12
]

_NCCL_INCLUDE_CANDIDATES = [
    "../nvidia/nccl/include",
]

def _first_existing(ctx, base, candidates, fallback):
    for rel in candidates:
        p = ctx.path(base + "/" + rel)
        if p.exists:
            return str(p)
    return fallback

def _torch_dir(ctx):
    home = ctx.os.environ.get("LIBTORCH_HOME", "")
    if home:
        return home
    python = project_python(ctx) or "python3"
    res = ctx.execute([python, "-c", "import os, torch; print(os.path.dirname(torch.__file__))"])
    if res.return_code != 0:
        fail("@libtorch: no LibTorch found. Run tools/setup.sh (installs the pinned torch package) " +
             "or set LIBTORCH_HOME to an unpacked LibTorch. python3 said: " + res.stderr)
    return res.stdout.strip()

def _libtorch_repository_impl(ctx):
    torch_dir = _torch_dir(ctx)
    for sub in ["include", "lib"]:
        if not ctx.path(torch_dir + "/" + sub).exists:
            fail("@libtorch: %s has no %s/ folder; is it a LibTorch or torch package?" % (torch_dir, sub))
    ctx.symlink(torch_dir + "/include", "include")
    ctx.symlink(torch_dir + "/lib", "lib")
    ctx.symlink(_first_existing(ctx, torch_dir, _CUDA_INCLUDE_CANDIDATES, "/usr/local/cuda/include"), "cuda_include")
    ctx.symlink(_first_existing(ctx, torch_dir, _NCCL_INCLUDE_CANDIDATES, "/usr/local/cuda/include"), "nccl_include")
    lib_dir = str(ctx.path(torch_dir + "/lib").realpath)
    # The CUDA runtime that LibTorch was built against (inline c10/cuda helpers call it directly).
    cudart_dir = _first_existing(ctx, torch_dir, _CUDART_LIB_CANDIDATES, "/usr/local/cuda/lib64")
    cudart = ""
    for entry in ctx.path(cudart_dir).readdir():
        if entry.basename.startswith("libcudart.so"):
            cudart = entry.basename
            break
    cudart_linkopts = ["-L" + cudart_dir, "-Wl,-rpath," + cudart_dir, "-l:" + cudart] if cudart else []
    ctx.template("BUILD.bazel", ctx.attr.build_template, {
        "%{LIB_DIR}": lib_dir,
        "%{CUDART_LINKOPTS}": repr(cudart_linkopts),
    })

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    # A Label, not a string: resolved in this repository even when another workspace declares @libtorch.
    attrs = {"build_template": attr.label(default = Label("//third_party/libtorch:libtorch.BUILD.tpl"))},
    environ = ["LIBTORCH_HOME", "PYTHON_BIN_PATH", "FSDP_VENV", "HOME"],
    local = True,
)

def repo():
    libtorch_repository(name = "libtorch")
