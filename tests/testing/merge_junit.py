"""Merges the per-world-size JUnit reports of one multi-rank test binary into one file.

usage: merge_junit.py OUT NAME N:RC:REPORT...
Each test case appears once per world size, its suite named "NAME [N ranks]". A launch whose report
is missing or unreadable (a rank crashed or the job was aborted) becomes one failed test case.
Prints "world size N: P passed, F failed" per launch.
"""
import sys
import xml.etree.ElementTree as ET


def main():
    out, name, launches = sys.argv[1], sys.argv[2], sys.argv[3:]
    merged = ET.Element("testsuites")
    any_failed = False
    for launch in launches:
        n, rc, path = launch.split(":", 2)
        suite = ET.SubElement(merged, "testsuite", name=f"{name} [{n} ranks]")
        cases = []
        try:
            root = ET.parse(path).getroot()
            suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
            for s in suites:
                cases.extend(s.findall("testcase"))
        except (OSError, ET.ParseError) as e:
            case = ET.SubElement(suite, "testcase", classname=name, name=f"launch on {n} ranks")
            ET.SubElement(case, "failure", message=f"no report (exit code {rc}): {e}")
            cases = [case]
        else:
            for c in cases:
                c.set("name", f"{c.get('name')} [{n} ranks]")
                suite.append(c)
            if rc != "0" and not any(c.find("failure") is not None or c.find("error") is not None for c in cases):
                case = ET.SubElement(suite, "testcase", classname=name, name=f"launch on {n} ranks")
                ET.SubElement(case, "failure", message=f"mpirun exited with {rc}")
                cases.append(case)
        failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(failed))
        suite.set("errors", "0")
        any_failed |= failed > 0
        print(f"{name}: world size {n}: {len(cases) - failed} passed, {failed} failed")
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
