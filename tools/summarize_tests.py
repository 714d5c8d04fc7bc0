"""Counts test cases over the JUnit reports of a `bazel test` run and prints "N passed, M failed".

usage: summarize_tests.py TESTLOGS_DIR BAZEL_EXIT_CODE
Multi-rank tests report each Catch2 test case once per world size; other tests count as one case.
Exits non-zero when anything failed or when Bazel itself failed (e.g. a build error), which then
also counts as a failed case if no report shows a failure. Checks run outside Bazel (e.g. the
consumer workspace of tools/consumer_check.sh) are counted from the file named by
FSDP_EXTRA_RESULTS: one line per check, "<name> passed" or "<name> failed".
"""
import os
import sys
import xml.etree.ElementTree as ET


def main():
    logs, bazel_rc = sys.argv[1], int(sys.argv[2])
    passed = failed = 0
    failed_names = []
    for root_dir, _, files in os.walk(logs, followlinks=True):
        if "test.xml" not in files:
            continue
        path = os.path.join(root_dir, "test.xml")
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except ET.ParseError:
            failed += 1
            failed_names.append(f"unreadable report {path}")
            continue
        for case in cases:
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                failed_names.append(case.get("name"))
            else:
                passed += 1
    extra = os.environ.get("FSDP_EXTRA_RESULTS")
    if extra and os.path.exists(extra):
        for line in open(extra):
            name, _, result = line.strip().rpartition(" ")
            if result == "passed":
                passed += 1
            elif result == "failed":
                failed += 1
                failed_names.append(name)
    if bazel_rc != 0 and failed == 0:
        failed += 1
        failed_names.append(f"bazel test exited with {bazel_rc} (build failure or test timeout)")
    for name in failed_names:
        print(f"FAILED: {name}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
