#!/usr/bin/env bash
# Installs whatever the project needs and this machine lacks; safe to run again, and fast when
# everything is there. Debian 12: Bazel 4 (bazel-bootstrap, bazel-rules-java), Catch2, Open MPI;
# PyPI: the pinned torch package (the LibTorch we build against; version in tools/TORCH_VERSION),
# installed machine-wide so every clone finds it, and the safetensors package (tests check that Python
# reads and writes our checkpoints). Set LIBTORCH_HOME to use an unpacked LibTorch
# instead of the torch package.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[setup] $*"; }

debs=(bazel-bootstrap bazel-rules-java catch2 libopenmpi-dev openmpi-bin python3 nlohmann-json3-dev)
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

torch_version=$(tr -d '[:space:]' < tools/TORCH_VERSION)
if [ -n "${LIBTORCH_HOME:-}" ]; then
  [ -d "$LIBTORCH_HOME/include" ] && [ -d "$LIBTORCH_HOME/lib" ] ||
    { echo "[setup] LIBTORCH_HOME=$LIBTORCH_HOME has no include/ and lib/"; exit 1; }
  log "using LibTorch from LIBTORCH_HOME=$LIBTORCH_HOME"
else
  installed=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
  if [ "$installed" != "$torch_version" ]; then
    log "installing torch==$torch_version from PyPI (with its CUDA runtime wheels; several GB, once per machine)"
    pip_args=(install --quiet "torch==$torch_version")
    if ! python3 -m pip "${pip_args[@]}" 2> /tmp/fsdp_setup_pip.err; then
      if grep -q externally-managed /tmp/fsdp_setup_pip.err; then
        python3 -m pip "${pip_args[@]}" --break-system-packages
      else
        cat /tmp/fsdp_setup_pip.err >&2
        exit 1
      fi
    fi
  fi
fi
# Python packages beside torch, in the interpreter that has torch (checkpoint interop tests).
safetensors_version=0.8.0
py_missing=()
python3 -c "import safetensors, sys; sys.exit(safetensors.__version__ != '$safetensors_version')" 2>/dev/null ||
  py_missing+=("safetensors==$safetensors_version")
if [ ${#py_missing[@]} -gt 0 ]; then
  log "installing ${py_missing[*]} from PyPI"
  if ! python3 -m pip install --quiet "${py_missing[@]}" 2> /tmp/fsdp_setup_pip.err; then
    if grep -q externally-managed /tmp/fsdp_setup_pip.err; then
      python3 -m pip install --quiet "${py_missing[@]}" --break-system-packages
    else
      cat /tmp/fsdp_setup_pip.err >&2
      exit 1
    fi
  fi
fi
log "ready: $(bazel --version 2>/dev/null | head -1), Open MPI $(mpirun --version 2>/dev/null | head -1 | awk '{print $NF}'), torch ${LIBTORCH_HOME:-$torch_version}"
