"""Checks that the README's consumer snippets are exactly what examples/consumer builds.

usage: check_readme_snippets.py [REPO_ROOT]

- The first ```cpp block under "## Using fully_shard" must be examples/consumer/train.cc, byte for
  byte (tools/consumer_check.sh then builds and runs it, so the README's example builds as written).
- The first ```cpp block under "## Optimizers on flat shards" must be
  tests/optim/flat_optimizer_example.cc, byte for byte (built by //tests/optim:flat_optimizer_example).
- The first ```cpp block under "## Quantized communication" must be
  tests/composable/quantized_comm_example.cc, byte for byte (built by
  //tests/composable:quantized_comm_example).
- The first ```cpp block under "### Point-to-point (`send`, `recv`)" must be
  tests/comm/point_to_point_example.cc, byte for byte (built by //tests/comm:point_to_point_example).
- The first ```cpp block under "## Pipeline parallel" must be tests/pipeline/pipeline_example.cc,
  byte for byte (built by //tests/pipeline:pipeline_example, run on 1-4 ranks by its test).
- The first ```cpp block under "## One training job: ..." must be
  tests/parallel/composition_example.cc, byte for byte (built and run by
  //tests/parallel:composition_example_test).
- Under "## Using the library from another Bazel workspace": the ```python block with `cc_binary(`
  must appear verbatim in examples/consumer/BUILD.bazel; the lines of the WORKSPACE block that load
  and call fsdp_dependencies must appear in examples/consumer/WORKSPACE; the ```text block of
  .bazelrc lines must be the option lines of examples/consumer/.bazelrc.
Prints what differs (a unified diff) and exits 1, or prints "readme snippets: match" and exits 0.
"""
import difflib
import os
import re
import sys


def section(readme, heading):
    start = readme.find("\n" + heading + "\n")
    if start < 0:
        raise SystemExit(f"check_readme_snippets: README.md has no heading '{heading}'")
    rest = readme[start + len(heading) + 2:]
    end = re.search(r"^## ", rest, re.M)
    return rest[: end.start()] if end else rest


def blocks(text, lang):
    return re.findall(r"^```" + lang + r"\n(.*?)^```", text, re.M | re.S)


def option_lines(text):
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    read = lambda rel: open(os.path.join(root, rel)).read()
    readme = read("README.md")
    problems = []

    def differ(what, expected, got, a, b):
        problems.append(what + ":\n" + "".join(difflib.unified_diff(
            expected.splitlines(True), got.splitlines(True), a, b)))

    def first_cpp_block_is(heading, path):
        found = blocks(section(readme, heading), "cpp")
        expected = read(path)
        if not found:
            problems.append(f"README.md: no ```cpp block under '{heading}'")
        elif found[0] != expected:
            differ(f"the README's example under '{heading}' is not {path}", expected, found[0], path,
                   f"README.md ({heading[3:]})")

    first_cpp_block_is("## Using fully_shard", "examples/consumer/train.cc")
    first_cpp_block_is("### Point-to-point (`send`, `recv`)", "tests/comm/point_to_point_example.cc")
    first_cpp_block_is("## Optimizers on flat shards", "tests/optim/flat_optimizer_example.cc")
    first_cpp_block_is("## Quantized communication", "tests/composable/quantized_comm_example.cc")
    first_cpp_block_is("## Pipeline parallel", "tests/pipeline/pipeline_example.cc")
    first_cpp_block_is("## One training job: tensor parallel x fully_shard x pipeline (`fsdp::parallel`)",
                       "tests/parallel/composition_example.cc")
    first_cpp_block_is("## Models: Llama from a Hugging Face folder (`models/`)", "examples/llama_finetune.cc")

    consumer = section(readme, "## Using the library from another Bazel workspace")
    build = read("examples/consumer/BUILD.bazel")
    rules = [b for b in blocks(consumer, "python") if "cc_binary(" in b]
    if not rules:
        problems.append("README.md: no ```python block with cc_binary( in the Bazel workspace section")
    for rule in rules:
        if rule not in build:
            differ("the README's BUILD block is not in examples/consumer/BUILD.bazel", build, rule,
                   "examples/consumer/BUILD.bazel", "README.md (BUILD block)")
    workspace = read("examples/consumer/WORKSPACE")
    for b in blocks(consumer, "python"):
        for line in b.splitlines():
            if "fsdp_dependencies" in line and line.strip() not in workspace:
                problems.append(f"README.md's WORKSPACE line '{line.strip()}' is not in examples/consumer/WORKSPACE")
    rc = blocks(consumer, "text")
    want = option_lines(read("examples/consumer/.bazelrc"))
    if not rc:
        problems.append("README.md: no ```text block of .bazelrc lines in the Bazel workspace section")
    elif option_lines(rc[0]) != want:
        differ("the README's .bazelrc lines are not examples/consumer/.bazelrc's",
               "\n".join(want) + "\n", "\n".join(option_lines(rc[0])) + "\n",
               "examples/consumer/.bazelrc", "README.md (.bazelrc block)")

    for p in problems:
        print(p)
    print("readme snippets: " + ("match" if not problems else f"{len(problems)} differences"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
