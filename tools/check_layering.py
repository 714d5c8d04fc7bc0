#!/usr/bin/env python3
"""Checks that every cc target includes only the project headers its direct deps provide.

gcc cannot run Bazel's layering_check, and actions run unsandboxed (.bazelrc: --spawn_strategy=local),
so a header that reaches a target only through a dependency of a dependency compiles today and
breaks when that dependency drops it. This check closes the gap: for every cc_library, cc_binary and
cc_test of the workspace (one `bazel query`), each `#include "..."` of a project header in its srcs
and hdrs must name a header of the target itself or of one of its direct deps (an alias counts as
its actual target), and a declared header must be written with the project's prefix
("fsdp_cpp/<path>", tools/build_defs.bzl): the unprefixed path still compiles inside this workspace
(the workspace root is on the include path) but could name another workspace's header in a
monorepo. Headers of other repositories (LibTorch, MPI, ...) are not checked.

    tools/check_layering.py [workspace root]     # default: this script's repository

Prints one line per violation,

    //x:t: x/a.cc includes y/b.h (provided by //y:b, not a direct dep)

and exits 1 when there is any, else prints "layering check: N targets, M includes, no violations"
and exits 0. Needs python3 (standard library only) and bazel on PATH.
"""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

_CC_KINDS = ("cc_library", "cc_binary", "cc_test")
_FILE_ATTRS = ("srcs", "hdrs", "textual_hdrs")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
_PREFIX = "fsdp_cpp/"


def query_rules(root):
    """{label: (kind, {attr: [labels]}, actual)} for every cc rule and alias of the workspace."""
    expr = 'kind("^(%s|alias) rule$", //...)' % "|".join(_CC_KINDS)
    result = subprocess.run(
        ["bazel", "query", "--output=xml", "--noimplicit_deps", expr],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr)
        raise SystemExit("layering check: bazel query failed")
    rules = {}
    for rule in ElementTree.fromstring(result.stdout).iter("rule"):
        attrs = {}
        actual = None
        for element in rule:
            name = element.get("name")
            if element.tag == "list" and name in _FILE_ATTRS + ("deps",):
                attrs[name] = [label.get("value") for label in element.iter("label")]
            elif element.tag == "label" and name == "actual":
                actual = element.get("value")
        rules[rule.get("name")] = (rule.get("class"), attrs, actual)
    return rules


def source_path(label):
    """The workspace-relative path of a source-file label of this repository, else None."""
    if not label.startswith("//"):
        return None
    package, _, name = label[2:].partition(":")
    return os.path.join(package, name) if package else name


def resolve(label, rules):
    """`label` with aliases followed to the rule they name."""
    seen = set()
    while label in rules and rules[label][0] == "alias" and label not in seen:
        seen.add(label)
        label = rules[label][2] or label
    return label


def included_headers(root, path):
    """The quoted includes of a workspace file that name a file of it: (as written, path, prefixed)."""
    try:
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as source:
            lines = source.readlines()
    except OSError:
        return []
    found = []
    for line in lines:
        match = _INCLUDE.match(line)
        if not match:
            continue
        name = match.group(1)
        # The compiler looks beside the including file first, then on the include path (here: the
        # workspace root).
        beside = os.path.normpath(os.path.join(os.path.dirname(path), name))
        if os.path.dirname(name) == "" and os.path.isfile(os.path.join(root, beside)):
            found.append((name, beside, True))
        elif name.startswith(_PREFIX) and os.path.isfile(os.path.join(root, name[len(_PREFIX):])):
            found.append((name, os.path.normpath(name[len(_PREFIX):]), True))
        elif os.path.isfile(os.path.join(root, name)):
            found.append((name, os.path.normpath(name), False))
    return found


def check(root):
    rules = query_rules(root)
    cc_rules = {label: rule for label, rule in rules.items() if rule[0] in _CC_KINDS}
    providers = {}  # header path -> labels whose hdrs (or textual_hdrs) declare it
    for label, (_, attrs, _) in cc_rules.items():
        for attr in ("hdrs", "textual_hdrs"):
            for file_label in attrs.get(attr, []):
                path = source_path(file_label)
                if path:
                    providers.setdefault(path, []).append(label)

    violations = []
    includes = 0
    for label in sorted(cc_rules):
        _, attrs, _ = cc_rules[label]
        own = {source_path(f) for attr in _FILE_ATTRS for f in attrs.get(attr, [])}
        own.discard(None)
        direct = {resolve(dep, rules) for dep in attrs.get("deps", [])}
        for path in sorted(own):
            for written, header, prefixed in included_headers(root, path):
                includes += 1
                by = providers.get(header, [])
                if by and not prefixed:
                    violations.append('%s: %s includes "%s" (write "%s%s")' %
                                      (label, path, written, _PREFIX, written))
                    continue
                if header in own:
                    continue
                if any(provider in direct for provider in by):
                    continue
                if by:
                    why = "provided by %s, not a direct dep" % ", ".join(sorted(by))
                else:
                    why = "in no target's hdrs"
                violations.append("%s: %s includes %s (%s)" % (label, path, written, why))
    for line in violations:
        print(line)
    if violations:
        print("layering check: %d violations in %d targets" %
              (len(violations), len({v.split(": ", 1)[0] for v in violations})))
        return 1
    print("layering check: %d targets, %d includes, no violations" % (len(cc_rules), includes))
    return 0


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return check(os.path.abspath(root))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
