"""Declares @torch_python: the Python interpreter that imports both torch and safetensors, for tests
that run Python scripts (checkpoint interoperability with torch.distributed.checkpoint).

The interpreter is PYTHON_BIN_PATH if set, else the project's virtual environment that tools/setup.sh
builds from tools/requirements.txt (FSDP_VENV, default ~/.cache/fsdp_cpp/venv), else the first
`python3` on PATH. Its real executable (`sys.executable`, so a pyenv shim is
resolved to the binary behind it) is recorded as an absolute path, because Bazel runs tests with a
PATH of its own.

Targets:
  @torch_python//:python      an executable wrapper (sh_binary) that execs that interpreter with its
                              arguments. Use it from an sh_test:
                                  data = ["@torch_python//:python", "script.py"],
                                  args = ["$(rootpath @torch_python//:python)", "$(rootpath script.py)"],
                              the test runs `"$1" "$2" ...` (both paths are relative to the runfiles
                              folder the test starts in).
  @torch_python//:defs.bzl    TORCH_PYTHON = "/absolute/path/to/python" and the versions found, for
                              rules that need the path itself (load("@torch_python//:defs.bzl", ...)).
"""

_PROBE = """
import sys
import torch, safetensors
print(sys.executable)
print(torch.__version__)
print(safetensors.__version__)
"""

def project_python(ctx):
    """PYTHON_BIN_PATH, else the interpreter of tools/setup.sh's environment if it exists, else ""."""
    python = ctx.os.environ.get("PYTHON_BIN_PATH", "")
    if python:
        return python
    venv = ctx.os.environ.get("FSDP_VENV", "")
    if not venv and ctx.os.environ.get("HOME", ""):
        venv = ctx.os.environ["HOME"] + "/.cache/fsdp_cpp/venv"
    if venv and ctx.path(venv + "/bin/python").exists:
        return venv + "/bin/python"
    return ""

def _torch_python_repository_impl(ctx):
    python = project_python(ctx)
    if not python:
        found = ctx.which("python3")
        if found == None:
            fail("@torch_python: no python3 on PATH. Run tools/setup.sh (installs torch and " +
                 "safetensors) or set PYTHON_BIN_PATH to an interpreter that has both.")
        python = str(found)
    res = ctx.execute([python, "-c", _PROBE])
    if res.return_code != 0:
        fail(("@torch_python: %s cannot import torch and safetensors. Run tools/setup.sh (installs " +
              "both into the interpreter that has torch) or set PYTHON_BIN_PATH to one that has " +
              "both. Python said: %s") % (python, res.stderr))
    lines = res.stdout.strip().split("\n")
    if len(lines) != 3 or not lines[0].startswith("/"):
        fail("@torch_python: unexpected answer from %s: %s" % (python, res.stdout))
    executable, torch_version, safetensors_version = lines[0].strip(), lines[1].strip(), lines[2].strip()

    ctx.file("python.sh", """#!/bin/sh
# Runs the interpreter that imports torch {torch} and safetensors {st} (found by @torch_python).
exec "{exe}" "$@"
""".format(exe = executable, torch = torch_version, st = safetensors_version), executable = True)
    ctx.file("defs.bzl", """\"\"\"Facts @torch_python recorded about the interpreter it found.\"\"\"

TORCH_PYTHON = "{exe}"
TORCH_VERSION = "{torch}"
SAFETENSORS_VERSION = "{st}"
""".format(exe = executable, torch = torch_version, st = safetensors_version))
    ctx.file("BUILD.bazel", """package(default_visibility = ["//visibility:public"])

# Execs {exe} (torch {torch}, safetensors {st}) with its arguments.
sh_binary(
    name = "python",
    srcs = ["python.sh"],
)

exports_files(["defs.bzl", "python.sh"])
""".format(exe = executable, torch = torch_version, st = safetensors_version))

torch_python_repository = repository_rule(
    implementation = _torch_python_repository_impl,
    environ = ["PYTHON_BIN_PATH", "FSDP_VENV", "HOME", "PATH"],
    local = True,
)

def repo():
    torch_python_repository(name = "torch_python")
