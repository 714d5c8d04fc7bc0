#!/usr/bin/env bash
# Installs whatever the project needs and this machine lacks; safe to run again, and fast when
# everything is there. Debian 12: Bazel 4 (bazel-bootstrap, bazel-rules-java), Catch2, Open MPI,
# CMake and Ninja;
# PyPI: every package of tools/requirements.txt (torch, the LibTorch we build against; safetensors
# and numpy for the interop tests), pinned, in a virtual environment of the project's shared by every
# clone on this machine (~/.cache/fsdp_cpp/venv; see tools/python_env.sh). `tools/setup.sh --bench`
# also builds the benchmarks' environment (tools/requirements-bench.txt). Set LIBTORCH_HOME to build
# against an unpacked LibTorch instead of the torch package.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[setup] $*"; }

# cmake and ninja-build: the CMake build (CMakeLists.txt, tools/cmake/check.sh); it finds
# nlohmann_json and Catch2 through the CMake packages of nlohmann-json3-dev and catch2.
# clang (Debian's Clang 14) compiles this workspace's Bazel build (.bazelrc) and CI's CMake build of
# the library; libclang-rt-14-dev holds its sanitizer runtimes, lld links the sanitizer builds. g++ (the system's compiler)
# compiles the consumer checks.
debs=(bazel-bootstrap bazel-rules-java catch2 libopenmpi-dev openmpi-bin python3 python3-venv nlohmann-json3-dev
      cmake ninja-build clang libclang-rt-14-dev lld g++)
missing=()
for pkg in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q "${missing[@]}"
fi

. tools/python_env.sh
want_bench=0
[ "${1:-}" = "--bench" ] && want_bench=1

# The Python environment: a virtual environment holding exactly tools/requirements.txt and what it
# depends on, nothing from the machine's own site-packages. It is rebuilt from scratch when the list
# changes or when its contents differ from what was installed (a package added by hand), so a test
# that needs a package the list does not name fails here as on a fresh machine. Wheels come from
# pip's cache after the first time (a rebuild takes a minute or two, not a download of torch).
env_state() {  # the list and the environment's contents, one line each
  cat "$1"
  echo "--- installed"
  "$2" -m pip freeze --all 2>/dev/null | LC_ALL=C sort
}
make_env() {  # make_env VENV REQUIREMENTS [LAYER_SITE_PACKAGES]
  local venv=$1 req=$2 layer=${3:-}
  local stamp="$venv/.fsdp_env_state"
  if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] &&
     [ "$(env_state "$req" "$venv/bin/python")" = "$(cat "$stamp")" ]; then
    return 0
  fi
  log "building the Python environment $venv from $req"
  rm -rf "$venv"
  python3 -m venv "$venv" || { echo "[setup] python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; return 1; }
  if [ -n "$layer" ]; then  # see the packages of the environment below as installed
    echo "$layer" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fsdp_layer.pth"
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" || return 1
  env_state "$req" "$venv/bin/python" > "$stamp"
}
if [ -n "${LIBTORCH_HOME:-}" ]; then
  [ -d "$LIBTORCH_HOME/include" ] && [ -d "$LIBTORCH_HOME/lib" ] ||
    { echo "[setup] LIBTORCH_HOME=$LIBTORCH_HOME has no include/ and lib/"; exit 1; }
  log "using LibTorch from LIBTORCH_HOME=$LIBTORCH_HOME (the Python tests still use $FSDP_VENV)"
fi
make_env "$FSDP_VENV" tools/requirements.txt || exit 1
if [ "$want_bench" = 1 ]; then
  site=$("$FSDP_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  make_env "$FSDP_BENCH_VENV" tools/requirements-bench.txt "$site" || exit 1
fi
torch_version=$("$FSDP_PYTHON" -c 'import torch; print(torch.__version__)')
log "ready: $(bazel --version 2>/dev/null | head -1), Open MPI $(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}'), torch ${LIBTORCH_HOME:-$torch_version}, Python $FSDP_PYTHON"
