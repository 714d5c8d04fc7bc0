# Sourced after tests/checkpoint/steps.sh by the parity tests: Python commands of a reference
# script queued and run in one process (tests/models/reference_batch.py: torch and transformers
# imported once), each still its own test case with its own output.
#   queue "STEP NAME" ARGS...      one command of the reference script (its arguments)
#   run_queue PYTHON SCRIPT         runs the queued commands in one process, then one `step` each
#                                   (in queue order, printing that command's output), and empties
#                                   the queue
_queue_names=()
_queue_lines=()
queue() {
  local name="$1"; shift
  _queue_names+=("$name")
  _queue_lines+=("$(printf '%q ' "$@")")
}
_queued_result() {  # prints command I's output, returns its status
  cat "$1.$2.log"
  local rc; rc=$(cat "$1.$2.rc" 2>/dev/null) || { echo "no result: the batch process ended before this command"; return 1; }
  return "$rc"
}
run_queue() {
  local python="$1" script="$2" list i
  [ ${#_queue_names[@]} -eq 0 ] && return 0
  list=$(mktemp "$work/queue.XXXXXX")
  printf '%s\n' "${_queue_lines[@]}" > "$list"
  echo "=== ${#_queue_names[@]} commands of $(basename "$script") in one process"
  "$python" "$script" batch "$list" || echo "the batch process failed (status $?)"
  for i in "${!_queue_names[@]}"; do
    step "${_queue_names[$i]}" _queued_result "$list" "$i"
  done
  _queue_names=(); _queue_lines=()
}
