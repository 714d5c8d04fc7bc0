#!/usr/bin/env bash
# Checks the multi-rank harness on harness_probe_main, whose test cases have known outcomes.
set -u
runner="$1"; probe="$2"
work=$(mktemp -d /tmp/fsdph.XXXXXX)
trap 'rm -rf "$work"' EXIT
problems=0
expect() {  # expect FILE PATTERN WHAT
  if grep -qF -- "$2" "$1"; then echo "ok: $3"; else echo "MISSING: $3 ('$2')"; problems=$((problems + 1)); fi
}

XML_OUTPUT_FILE="$work/probe.xml" bash "$runner" "$probe" 1,2,3 "[probe]" > "$work/probe.log" 2>&1
rc=$?
cat "$work/probe.log"
[ $rc -ne 0 ] && echo "ok: failing probes make the launch fail" || { echo "WRONG: exit 0"; problems=$((problems + 1)); }
for n in 1 2 3; do
  expect "$work/probe.log" "world size $n: 2 passed, 2 failed" "2 of 4 probe cases fail on $n ranks"
done
expect "$work/probe.log" "[rank 1 of 2] FAILED in 'probe: a CHECK fails on the last rank only'" "the failing rank reports its check"
expect "$work/probe.log" "[rank 0 of 2] FAILED in 'probe: a CHECK fails on the last rank only'" "rank 0 reports the other rank's failure"
expect "$work/probe.log" "this test case failed on rank(s) 2 of 3" "passing ranks name the failing rank"
python3 - "$work/probe.xml" <<'PY' || problems=$((problems + 1))
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
failed = {c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None}
assert len(cases) == 12, f"expected 4 cases x 3 world sizes, got {len(cases)}"
for n in (1, 2, 3):
    assert f"probe: an exception on rank 0 only [{n} ranks]" in failed, failed
    assert f"probe: a CHECK fails on the last rank only [{n} ranks]" in failed, failed
    assert f"probe: passes on every rank [{n} ranks]" not in failed, failed
    assert f"probe: runs after the failures and passes [{n} ranks]" not in failed, failed
print("ok: merged JUnit report has every case once per world size with the right outcome")
PY

start=$(date +%s)
FSDP_TEST_TIMEOUT_S=3 XML_OUTPUT_FILE="$work/hang.xml" timeout 120 bash "$runner" "$probe" 2 "[hang]" > "$work/hang.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/hang.log"
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $elapsed -lt 60 ] && echo "ok: a rank failing before a collective ends the job in ${elapsed} s" ||
  { echo "WRONG: rc=$rc after ${elapsed} s"; problems=$((problems + 1)); }
expect "$work/hang.log" "allreduce #" "the timeout report names the collective"
expect "$work/hang.log" "world size 2: 0 passed, 1 failed" "the aborted launch counts as a failed case"
exit $problems
