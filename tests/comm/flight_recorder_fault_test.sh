#!/usr/bin/env bash
# Faults whose flight recorder dumps tools/flight_recorder.py must explain, on 3 ranks with a 2 s
# collective timeout (tests/comm/flight_recorder_fault_main.cc):
#   flight_recorder_fault_test.sh BINARY skip|diverge|recv
# skip: rank 2 skips collective #3 and stays alive; the tool names sequence number 3 and rank 2 as
# never arrived. diverge: rank 2 skips it and issues the next one; the tool names sequence number 3
# as the first difference, with rank 2's all_reduce against the others' all_gather_into_tensor.
# recv: rank 0 waits for a send rank 1 never posts; the tool names the recv and rank 1.
set -u
binary="$1"
mode="$2"
# tools/flight_recorder.py, beside this script's source (Bazel's runfiles link to it).
tool="$(dirname "$(readlink -f "$0")")/../../tools/flight_recorder.py"
[ -f "$tool" ] || { echo "FAILED: no tools/flight_recorder.py at $tool"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d /tmp/fsdpfr.XXXXXX)   # short: Open MPI keeps Unix sockets there
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
export FSDP_FLIGHT_RECORDER_DIR="$work/fr"
start=$(date +%s)
timeout -s KILL 60 mpirun --oversubscribe --bind-to none -np 3 -x OMP_NUM_THREADS -x FSDP_FLIGHT_RECORDER_DIR \
  "$binary" "$mode" > "$work/out.txt" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/out.txt"
echo "--- exit code $rc after ${elapsed} s"
ls -l "$FSDP_FLIGHT_RECORDER_DIR"
python3 "$tool" "$FSDP_FLIGHT_RECORDER_DIR" --world-size 3 > "$work/tool.txt" 2>&1
tool_rc=$?
echo "--- tools/flight_recorder.py (exit code $tool_rc):"
cat "$work/tool.txt"
problems=()
expect() { grep -qF -- "$1" "$work/$2" || problems+=("no '$1' in $2"); }
[ $rc -eq 0 ] && problems+=("the job exited 0")
[ "$elapsed" -ge 59 ] && problems+=("the job hung until the test's 60 s guard")
[ $tool_rc -ne 0 ] && problems+=("the tool exited $tool_rc")
case "$mode" in
  skip)
    for r in 0 1; do [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank$r.json" ] || problems+=("no dump of rank $r"); done
    expect "did not complete within 2000 ms" out.txt
    expect "tag 'save reports'; issued by fsdp::dcp::save)" tool.txt
    # Rank 2 dumps on the SIGTERM that ends it, unless mpirun killed it first: with its dump the
    # tool compares rings; without, it says how far the others went and that rank 2 left none.
    if [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank2.json" ]; then
      expect "the ranks first differ at sequence number 3: rank 2 never arrived (rank 2 at #2); ranks 0, 1 issued all_gather_into_tensor #3" tool.txt
      expect "rank 2 (pid" tool.txt
      expect "dumped on: signal SIGTERM" tool.txt
    else
      expect "no dump from rank 2" tool.txt
      expect "ranks 0, 1 issued up to sequence number 3 (all_gather_into_tensor #3" tool.txt
      expect "rank 2 left no dump" tool.txt
    fi
    expect "dumped on: collective all_gather_into_tensor #3" tool.txt
    ;;
  diverge)
    for r in 0 1 2; do [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank$r.json" ] || problems+=("no dump of rank $r"); done
    expect "the ranks first differ at sequence number 3 (kind, tag, element counts differ):" tool.txt
    expect "ranks 0, 1: all_gather_into_tensor #3 (Float; elements 16 in, 48 out; tag 'save reports'; issued by fsdp::dcp::save) [failed: MPI backend all_gather_into_tensor #3" tool.txt
    expect "rank 2: all_reduce #3 (Float; elements 1 in, 1 out; tag 'loss') [failed: MPI backend allreduce #3" tool.txt
    expect "dumped on: divergence: MPI backend" tool.txt
    ;;
  recv)
    [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank0.json" ] || problems+=("no dump of rank 0")
    expect "no send to this rank with tag 7 arrived from rank 1" out.txt
    expect "rank 0's recv #1 from group rank 1 (tag 7, #1 on that channel) (Float; elements 8 out; tag 'activations'; issued by pipeline stage 0) [issued]: " tool.txt
    if [ -f "$FSDP_FLIGHT_RECORDER_DIR/flight_recorder.rank1.json" ]; then
      expect "rank 1 never posted the matching send (it posted 0 sends on this channel); its last operation: barrier #2" tool.txt
    else
      expect "its peer, rank 1, left no dump" tool.txt
    fi
    ;;
esac
if [ ${#problems[@]} -gt 0 ]; then
  printf 'FAILED (%s): %s\n' "$mode" "${problems[@]}"
  exit 1
fi
echo "PASSED ($mode) after ${elapsed} s"
