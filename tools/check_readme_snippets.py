"""Checks that the code in the README and the manual (docs/*.md) is code that builds and runs.

usage: check_readme_snippets.py [REPO_ROOT]

The README is the front page; the manual is docs/, one page per topic. Both are read the same way:
a ```cpp block under a registered heading (SNIPPETS: page, heading, file) is compared with a file
that the build compiles and a test runs.

- "equal": the first ```cpp block under the heading must be the file, byte for byte.
- "excerpt": the first ```cpp block under the heading must be a run of whole lines of the file,
  verbatim (a short snippet of a program that is shown whole on another page).

The registered blocks (each file is built, and run on 1-4 ranks, by the target named beside it):
  README.md "## Using fully_shard" == examples/consumer/train.cc (tools/consumer_check.sh builds it
    from another Bazel workspace and runs it on 1 and 2 ranks)
  README.md "## The composition in one call" is an excerpt of tests/parallel/composition_example.cc
  docs/optimizers.md == tests/optim/flat_optimizer_example.cc (//tests/optim:flat_optimizer_example)
  docs/quantized_communication.md == tests/composable/quantized_comm_example.cc
  docs/communication.md "### Point-to-point" == tests/comm/point_to_point_example.cc
  docs/pipeline.md == tests/pipeline/pipeline_example.cc (//tests/pipeline:pipeline_example_test)
  docs/composition.md "## One training job ..." == tests/parallel/composition_example.cc
  docs/composition.md "## Models: Llama ..." == examples/llama_finetune.cc

Besides:
- Every ```cpp block in README.md or docs/*.md that is a whole program (it has `int main(`) must be
  a registered block: a program in the manual is never left unchecked. (Blocks that are fragments
  of a program, e.g. `fsdp::dcp::save(dir, root, &optim)`, are not compiled.)
- docs/bazel_workspace.md ("# Using the library from another Bazel workspace"): the ```python block
  with `cc_binary(` must appear verbatim in examples/consumer/BUILD.bazel; the lines of the
  WORKSPACE block that load and call fsdp_dependencies must appear in examples/consumer/WORKSPACE;
  the ```text block of .bazelrc lines must be the option lines of examples/consumer/.bazelrc.
- Every relative link in README.md, docs/*.md and tools/bench/README.md must name a file that
  exists, and a `#anchor` into a Markdown file must be one of its headings (GitHub's anchors), so
  moving a section cannot leave a dead link behind. PENDING lists pages another change adds.

Prints what differs (a unified diff) and exits 1, or prints "readme snippets: match" and exits 0.
"""
import difflib
import glob
import os
import re
import sys

EQUAL, EXCERPT = "equal", "excerpt"
SNIPPETS = [
    ("README.md", "## Using fully_shard", "examples/consumer/train.cc", EQUAL),
    ("README.md", "## The composition in one call", "tests/parallel/composition_example.cc", EXCERPT),
    ("docs/optimizers.md", "# Optimizers on flat shards", "tests/optim/flat_optimizer_example.cc", EQUAL),
    ("docs/quantized_communication.md", "# Quantized communication",
     "tests/composable/quantized_comm_example.cc", EQUAL),
    ("docs/communication.md", "### Point-to-point (`send`, `recv`)", "tests/comm/point_to_point_example.cc",
     EQUAL),
    ("docs/pipeline.md", "# Pipeline parallel", "tests/pipeline/pipeline_example.cc", EQUAL),
    ("docs/composition.md", "## One training job: tensor parallel x fully_shard x pipeline (`fsdp::parallel`)",
     "tests/parallel/composition_example.cc", EQUAL),
    ("docs/composition.md", "## Models: Llama from a Hugging Face folder (`models/`)", "examples/llama_finetune.cc",
     EQUAL),
]
BAZEL_PAGE, BAZEL_HEADING = "docs/bazel_workspace.md", "# Using the library from another Bazel workspace"
# Pages linked before they land (written by another change of the same issue); their links are
# checked once the file exists.
PENDING = {"docs/flight_recorder.md"}


def section(page, text, heading):
    """The text under `heading` up to the next heading of level 2 or higher (# or ##)."""
    text = "\n" + text
    start = text.find("\n" + heading + "\n")
    if start < 0:
        raise SystemExit(f"check_readme_snippets: {page} has no heading '{heading}'")
    rest = text[start + len(heading) + 2:]
    offset, fence = 0, False
    for line in rest.splitlines(True):   # a "# comment" inside a code block is no heading
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^##? ", line):
            return rest[:offset]
        offset += len(line)
    return rest


def blocks(text, lang):
    return re.findall(r"^```" + lang + r"\n(.*?)^```", text, re.M | re.S)


def option_lines(text):
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def github_anchor(heading):
    a = heading.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")


def anchors_of(text):
    found, seen, fence = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if m:
            a = github_anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            found.add(a if n == 0 else f"{a}-{n}")
    found.update(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    read = lambda rel: open(os.path.join(root, rel)).read()
    pages = ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    text = {p: read(p) for p in pages}
    problems = []
    checked = []

    def differ(what, expected, got, a, b):
        problems.append(what + ":\n" + "".join(difflib.unified_diff(
            expected.splitlines(True), got.splitlines(True), a, b)))

    registered = set()
    for page, heading, path, mode in SNIPPETS:
        if page not in text:
            problems.append(f"{page}: no such page (registered for {path})")
            continue
        found = blocks(section(page, text[page], heading), "cpp")
        expected = read(path)
        if not found:
            problems.append(f"{page}: no ```cpp block under '{heading}'")
            continue
        registered.add((page, found[0]))
        checked.append(f"{page} '{heading.lstrip('# ')}' {'==' if mode == EQUAL else 'in'} {path}")
        if mode == EQUAL and found[0] != expected:
            differ(f"{page}: the example under '{heading}' is not {path}", expected, found[0], path,
                   f"{page} ({heading.lstrip('# ')})")
        elif mode == EXCERPT and ("\n" + found[0]) not in ("\n" + expected):
            best = max(difflib.SequenceMatcher(None, found[0], expected).get_matching_blocks(),
                       key=lambda m: m.size)
            differ(f"{page}: the snippet under '{heading}' is not a run of lines of {path}",
                   expected[max(0, best.b - best.a):][: len(found[0]) + 200], found[0], path,
                   f"{page} ({heading.lstrip('# ')})")

    for page in pages:
        for b in blocks(text[page], "cpp"):
            if "int main(" in b and (page, b) not in registered:
                first = next((l for l in b.splitlines() if l.strip()), "")
                problems.append(f"{page}: a whole program (```cpp block starting '{first}') is compared with no "
                                "file: register its heading in tools/check_readme_snippets.py's SNIPPETS")

    consumer = section(BAZEL_PAGE, text[BAZEL_PAGE], BAZEL_HEADING)
    build = read("examples/consumer/BUILD.bazel")
    rules = [b for b in blocks(consumer, "python") if "cc_binary(" in b]
    if not rules:
        problems.append(f"{BAZEL_PAGE}: no ```python block with cc_binary( in the Bazel workspace section")
    for rule in rules:
        if rule not in build:
            differ(f"{BAZEL_PAGE}'s BUILD block is not in examples/consumer/BUILD.bazel", build, rule,
                   "examples/consumer/BUILD.bazel", f"{BAZEL_PAGE} (BUILD block)")
    workspace = read("examples/consumer/WORKSPACE")
    for b in blocks(consumer, "python"):
        for line in b.splitlines():
            if "fsdp_dependencies" in line and line.strip() not in workspace:
                problems.append(f"{BAZEL_PAGE}'s WORKSPACE line '{line.strip()}' is not in examples/consumer/WORKSPACE")
    rc = blocks(consumer, "text")
    want = option_lines(read("examples/consumer/.bazelrc"))
    if not rc:
        problems.append(f"{BAZEL_PAGE}: no ```text block of .bazelrc lines in the Bazel workspace section")
    elif option_lines(rc[0]) != want:
        differ(f"{BAZEL_PAGE}'s .bazelrc lines are not examples/consumer/.bazelrc's",
               "\n".join(want) + "\n", "\n".join(option_lines(rc[0])) + "\n",
               "examples/consumer/.bazelrc", f"{BAZEL_PAGE} (.bazelrc block)")
    checked.append(f"{BAZEL_PAGE}: the cc_binary, WORKSPACE and .bazelrc blocks against examples/consumer/")

    n_links = 0
    for page in pages + ["tools/bench/README.md"]:
        body = re.sub(r"^```.*?^```", "", text.get(page) or read(page), flags=re.M | re.S)
        body = re.sub(r"`[^`\n]*`", "", body)
        for target in re.findall(r"\]\(([^)\s]+)\)", body):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            n_links += 1
            if not os.path.exists(os.path.join(root, rel)):
                if rel not in PENDING:
                    problems.append(f"{page}: the link '{target}' names {rel}, which does not exist")
                continue
            if anchor and rel.endswith(".md") and anchor not in anchors_of(read(rel)):
                problems.append(f"{page}: the link '{target}': {rel} has no heading with the anchor '#{anchor}'")
    checked.append(f"{n_links} relative links in README.md, docs/*.md and tools/bench/README.md")

    for p in problems:
        print(p)
    if "-v" in sys.argv[2:] or os.environ.get("CHECK_SNIPPETS_VERBOSE"):
        print("checked:\n  " + "\n  ".join(checked))
    print("readme snippets: " + ("match" if not problems else f"{len(problems)} differences"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
