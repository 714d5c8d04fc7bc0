"""Checks that every Python package the tree imports is named in tools/requirements.txt.

usage: check_requirements.py [REPO_ROOT]

Reads every tracked *.py file and the Python embedded in tracked shell scripts (heredocs fed to a
python interpreter, `python -c '...'`) and Bazel files (probe strings), collects the top-level
modules they import (absolute imports, including those inside functions and try blocks), and
fails, naming the file and line, for each module that is neither in the standard library, nor a
module of this tree, nor provided by a distribution that tools/requirements.txt names (files under
tools/bench/ may also use tools/requirements-bench.txt). A module counts as provided by a listed
distribution when its name is the distribution's (normalized) or when the interpreter running this
check has that distribution installed and it provides the module (importlib.metadata).

This is the static half of the guard; the other half is that tools/setup.sh builds the Python
environment every test runs in from exactly that list, so a package needed only indirectly (numpy,
which torch.distributed imports at run time) fails the tests that need it.
Prints one line per problem and "python requirements: N imports checked, M problems"; exits 1 on a
problem.
"""
import ast
import importlib.metadata
import os
import re
import subprocess
import sys


def requirement_names(path):
    names = set()
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[<>=!~;\[ ]", line, 1)[0]
        names.add(normalize(name))
    return names


def normalize(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def tracked_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f]


def imports_of_source(source):
    """(module, line offset) for each absolute import; falls back to a line scan if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        found = []
        for i, line in enumerate(source.splitlines()):
            for m in re.finditer(r"(?:^|;)\s*(?:import\s+([\w., ]+)|from\s+(\w[\w.]*)\s+import)", line):
                if m.group(2):
                    found.append((m.group(2).split(".")[0], i))
                else:
                    for part in m.group(1).split(","):
                        part = part.strip().split(" ")[0]
                        if part:
                            found.append((part.split(".")[0], i))
        return found
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name.split(".")[0], node.lineno - 1))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno - 1))
    return found


HEREDOC = re.compile(r"python[0-9.]*\"?\s.*<<-?\s*['\"]?(\w+)['\"]?")
DASH_C = re.compile(r"python[0-9.]*\"?\s+-c\s+(['\"])(.*?)\1")
BZL_STRING = re.compile(r'"""(.*?)"""', re.S)


def embedded_sources(path, text):
    """(source, first line number) of the Python inside a shell script or a Bazel file."""
    if path.endswith(".sh"):
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            m = HEREDOC.search(lines[i])
            if m:
                tag, body, j = m.group(1), [], i + 1
                while j < len(lines) and lines[j].strip() != tag:
                    body.append(lines[j])
                    j += 1
                yield "\n".join(body), i + 2
                i = j
            for c in DASH_C.finditer(lines[i] if i < len(lines) else ""):
                yield c.group(2).replace("; ", "\n"), i + 1
            i += 1
    elif path.endswith(".bzl"):
        for m in BZL_STRING.finditer(text):
            if re.search(r"^\s*(import|from)\s+\w", m.group(1), re.M):
                yield m.group(1), text[: m.start()].count("\n") + 1


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    base = requirement_names(os.path.join(root, "tools/requirements.txt"))
    bench = base | requirement_names(os.path.join(root, "tools/requirements-bench.txt"))
    provided = {}  # module -> distributions installed here that provide it
    for module, dists in importlib.metadata.packages_distributions().items():
        provided[module] = {normalize(d) for d in dists}
    files = tracked_files(root)
    local = {os.path.splitext(os.path.basename(f))[0] for f in files if f.endswith(".py")}
    local |= {os.path.basename(os.path.dirname(f)) for f in files if f.endswith("__init__.py")}
    stdlib = set(sys.stdlib_module_names)
    checked = 0
    problems = []
    for f in files:
        if f.startswith("third_party/") and not f.endswith(".bzl"):
            continue
        if not (f.endswith(".py") or f.endswith(".sh") or f.endswith(".bzl")):
            continue
        text = open(os.path.join(root, f), encoding="utf-8", errors="replace").read()
        sources = [(text, 1)] if f.endswith(".py") else list(embedded_sources(f, text))
        allowed = bench if f.startswith("tools/bench/") else base
        listed = "tools/requirements.txt" + (" or tools/requirements-bench.txt" if allowed is bench else "")
        for source, first in sources:
            for module, offset in imports_of_source(source):
                checked += 1
                if module in stdlib or module in local or module == "__future__":
                    continue
                if normalize(module) in allowed or provided.get(module, set()) & allowed:
                    continue
                problems.append(f"{f}:{first + offset}: imports '{module}', which no package of {listed} provides")
    for p in problems:
        print(p)
    print(f"python requirements: {checked} imports checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
