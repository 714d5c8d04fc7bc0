#!/usr/bin/env bash
# CI's seeded run of the parser fuzzer (see BUILD.bazel): parser_fuzz_test.sh PARSER_FUZZ [ARGS...].
# FSDP_FUZZ_INPUTS changes the number of inputs per target (default 2000).
set -euo pipefail
fuzz="$1"
shift
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
findings="${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}/findings"
# First the hand-made inputs of the bugs found so far (each must be refused), then the seeded run.
"$fuzz" --regressions --work="$tmp/regressions" "$@"
# Per input 60 s (not 10): CI may compile beside the test on 2 cores.
exec "$fuzz" --inputs="${FSDP_FUZZ_INPUTS:-2000}" --seed=1 --timeout_s=60 --progress_s=0 \
  --work="$tmp/parser_fuzz" --findings="$findings" "$@"
