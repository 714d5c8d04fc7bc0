# Sourced by the checkpoint tests: each `step NAME COMMAND...` runs one check (several mpirun
# launches make one test), prints its output, and becomes one test case of the JUnit report that
# Bazel collects (XML_OUTPUT_FILE), so test counts show every check. `finish` writes the report and
# exits non-zero when a step failed.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# Bazel's TMPDIR is too long for Open MPI's socket paths: use a short folder, removed at exit.
work=$(mktemp -d /tmp/fsdpc.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"
_cases=()
_failures=0

# mpirun with the flags every launch needs: ranks may outnumber cores here.
mpi() {
  local n="$1"; shift
  mpirun --oversubscribe --bind-to none -np "$n" -x OMP_NUM_THREADS "$@"
}

step() {
  local name="$1"; shift
  echo "=== $name"
  local start=$SECONDS
  if "$@"; then
    _cases+=("pass|$name|$((SECONDS - start))")
  else
    echo "FAILED: $name"
    _cases+=("fail|$name|$((SECONDS - start))")
    _failures=$((_failures + 1))
  fi
}

finish() {
  local suite="$1"
  local out="${XML_OUTPUT_FILE:-$work/report.xml}"
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites><testsuite name=\"$suite\" tests=\"${#_cases[@]}\" failures=\"$_failures\">"
    for c in "${_cases[@]}"; do
      IFS='|' read -r status name secs <<< "$c"
      name=${name//&/&amp;}; name=${name//</&lt;}; name=${name//\"/&quot;}
      if [ "$status" = pass ]; then
        echo "<testcase classname=\"$suite\" name=\"$name\" time=\"$secs\"/>"
      else
        echo "<testcase classname=\"$suite\" name=\"$name\" time=\"$secs\"><failure message=\"failed\"/></testcase>"
      fi
    done
    echo '</testsuite></testsuites>'
  } > "$out"
  echo "${#_cases[@]} checks, $_failures failed"
  [ "$_failures" -eq 0 ]
}
