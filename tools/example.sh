#!/usr/bin/env bash
# Runs the main example, //examples:train_gpt (a small GPT trained with fully_shard on each block
# and on the root): installs what is missing, builds, and launches it over MPI ranks on this
# machine.   tools/example.sh [--np N] [train_gpt flags...]   (tools/example.sh --help lists them)
# With any of --dp, --dp-replicate, --tp or --pp it runs //examples:train_gpt_parallel instead: the
# composition root on that layout (tools/example.sh --np 4 --dp 2 --tp 2 --help lists its flags).
# With --model llama (or moe: a Qwen3-MoE) it runs //examples:train_lm: the model on the shipped
# token file through the composition root on any of those layouts, --hf-init DIR / --export-hf DIR
# for Hugging Face folders (tools/example.sh --model llama --np 4 --dp 2 --tp 2).
# //examples:train_gpt_pipeline composes the same APIs by hand (bazel run it, or see its test).
# The collectives demo is a separate target: bazel build //examples:collectives_demo.
set -euo pipefail
cd "$(dirname "$0")/.."
np=2
if [ "${1:-}" = "--np" ]; then np="$2"; shift 2; fi
target=train_gpt
prev=
for a in "$@"; do
  case "$a" in --dp|--dp-replicate|--tp|--pp) [ "$target" = train_gpt ] && target=train_gpt_parallel ;; esac
  if [ "$prev" = --model ]; then
    case "$a" in
      llama|moe) target=train_lm ;;
      *) echo "tools/example.sh: --model $a: the models are llama and moe" >&2; exit 2 ;;
    esac
  fi
  prev=$a
done
tools/setup.sh
bazel build "//examples:$target"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# A short TMPDIR: Open MPI's session directory holds Unix sockets, whose paths are limited.
work=$(mktemp -d /tmp/fsdpx.XXXXXX)
trap 'rm -rf "$work"' EXIT
TMPDIR="$work" mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS \
  "bazel-bin/examples/$target" "$@"
