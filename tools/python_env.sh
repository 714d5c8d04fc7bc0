# Sourced by the project's scripts: where the project's Python environments live.
#   FSDP_VENV          the test environment: exactly tools/requirements.txt (tools/setup.sh builds it)
#   FSDP_PYTHON        its interpreter; every Python test and tool that imports torch runs it
#   FSDP_BENCH_VENV    the benchmark environment: tools/requirements-bench.txt layered on FSDP_VENV
#   FSDP_BENCH_PYTHON  its interpreter (tools/setup.sh --bench builds it)
# PYTHON_BIN_PATH, when set, is the interpreter Bazel's @torch_python and @libtorch use instead.
FSDP_VENV="${FSDP_VENV:-$HOME/.cache/fsdp_cpp/venv}"
FSDP_PYTHON="$FSDP_VENV/bin/python"
FSDP_BENCH_VENV="${FSDP_BENCH_VENV:-$HOME/.cache/fsdp_cpp/venv-bench}"
FSDP_BENCH_PYTHON="$FSDP_BENCH_VENV/bin/python"
export FSDP_VENV FSDP_BENCH_VENV
