#!/usr/bin/env bash
# A save killed midway leaves the previous checkpoint loadable:
#   1. save checkpoint A (seed 1) on 3 ranks;
#   2. save B (seed 2) into the same folder while rank 1 dies (SIGKILL) after writing part of its
#      first file: the launch fails and the unfinished temporary folder stays behind;
#   3. load the folder on 2 ranks: it holds A, whole;
#   4. save C (seed 3) over it (the stale temporary folder is cleared) and load C on 3 ranks.
set -u
main="$1"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=1
# Bazel's TMPDIR is too long for Open MPI's socket paths: use a short folder, removed at exit.
work=$(mktemp -d /tmp/fsdpk.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
ckpt="$work/ckpt/latest"

launch() {
  local n="$1"; shift
  mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS "$@"
}
fail() { echo "FAILED: $*"; exit 1; }

echo "=== 1. save A"
launch 3 "$main" save "$ckpt" 1 || fail "saving A"
[ -f "$ckpt/fsdp_checkpoint.json" ] || fail "A has no manifest"
before=$(cd "$ckpt" && ls -l --time-style=+%s.%N | md5sum)

echo "=== 2. save B, rank 1 killed while writing"
launch 3 env FSDP_DCP_TEST_KILL_RANK=1 "$main" save "$ckpt" 2 > "$work/killed.log" 2>&1
rc=$?
cat "$work/killed.log"
[ $rc -ne 0 ] || fail "the killed launch exited with 0"
grep -q "rank 1: killed while writing" "$work/killed.log" || fail "rank 1 was not killed while writing"
partial=$(find "$work/ckpt" -mindepth 1 -maxdepth 1 -type d ! -name latest)
[ -n "$partial" ] || fail "no unfinished temporary folder was left (was the save killed midway?)"
ls -l $partial
after=$(cd "$ckpt" && ls -l --time-style=+%s.%N | md5sum)
[ "$before" = "$after" ] || fail "the files of checkpoint A changed"

echo "=== 3. load: A"
launch 2 "$main" check "$ckpt" 1 || fail "the folder does not hold A after the killed save"

echo "=== 4. save C over it, load C"
launch 3 "$main" save "$ckpt" 3 || fail "saving C"
launch 3 "$main" check "$ckpt" 3 || fail "the folder does not hold C"
[ -z "$(find "$work/ckpt" -mindepth 1 -maxdepth 1 -type d ! -name latest)" ] || fail "a temporary folder remains"
echo "PASSED"
