#!/usr/bin/env bash
# torchrun --no-python entry point of a mixed job: the rank with LOCAL_RANK=PY_LOCAL_RANK is Python
# (torch's own env:// rendezvous), the others the C++ program.
#   torchrun_mixed_worker.sh PY_LOCAL_RANK PYTHON PY_WORKER CPP_BINARY ARGS...
py_rank="$1"; py="$2"; worker="$3"; binary="$4"; shift 4
if [ "${LOCAL_RANK:-0}" = "$py_rank" ]; then exec "$py" "$worker" "$@"; fi
exec "$binary" "$@"
