#!/usr/bin/env bash
# fully_shard jobs whose ranks diverge (tests/comm/issuing_api_main.cc) end quickly, with every rank
# naming the collective and the API that issued it; without FSDP_DEBUG, never MPI_ERR_TRUNCATE.
#   issuing_api_test.sh BINARY save_rank0|extra_forward
set -u
binary="$1"
mode="$2"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export FSDP_COMM_TIMEOUT_S=2
work=$(mktemp -d /tmp/fsdpi.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
failures=0
for n in 2 3; do
  start=$(date +%s)
  timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS -x FSDP_COMM_TIMEOUT_S \
    "$binary" "$mode" "$work" > "$work/out_$n.txt" 2>&1
  rc=$?
  elapsed=$(( $(date +%s) - start ))
  cat "$work/out_$n.txt"
  problems=()
  expect() { grep -qF -- "$1" "$work/out_$n.txt" || problems+=("no '$1' in the output"); }
  [ $rc -eq 0 ] && problems+=("the job exited 0")
  [ "$elapsed" -gt 30 ] && problems+=("it took ${elapsed} s")
  grep -q "MPI_ERR_TRUNCATE" "$work/out_$n.txt" && problems+=("an MPI_ERR_TRUNCATE error")
  case "$mode" in
    save_rank0)
      expect "did not complete within 2000 ms"
      expect "issued by fsdp::dcp::save"
      ;;
    extra_forward)
      for ((r = 0; r < n; r++)); do
        expect "rank $r: step 2 done"
        grep -q "^rank $r: error: MPI backend .* issued by fully_shard .*: the ranks of the group issued different collectives at this point: .*FSDP_DEBUG=1" \
          "$work/out_$n.txt" || problems+=("rank $r did not report the mismatch with its API")
      done
      ;;
    *) echo "unknown mode '$mode'"; exit 2 ;;
  esac
  if [ ${#problems[@]} -gt 0 ]; then
    for p in "${problems[@]}"; do echo "FAILED ($mode, $n ranks): $p"; done
    failures=$((failures + 1))
  else
    echo "PASSED ($mode, $n ranks): ended after ${elapsed} s (exit code $rc)"
  fi
done
exit $failures
