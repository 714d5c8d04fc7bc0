#!/usr/bin/env bash
# Python's safetensors package reads a file of the C++ writer (every dtype, metadata):
# the safetensors_test case "a file for Python to read back" writes it, read_with_python.py checks it.
# usage: python_reads_test.sh SAFETENSORS_TEST PYTHON READ_WITH_PYTHON_PY
set -eu
test_bin="$1"; python="$2"; script="$3"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
FSDP_STORAGE_INTEROP_DIR="$out" "$test_bin" "a file for Python to read back*"
"$python" "$script" "$out/interop.safetensors" "$out/interop.expected.json" format=pt
