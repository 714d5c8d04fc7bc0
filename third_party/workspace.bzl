"""Every external dependency of the project, declared in one place.

This repository's WORKSPACE calls it, and so does any other workspace that uses the library (a
monorepo): declare this repository, then call the macro.

    local_repository(name = "fsdp_cpp", path = "third_party/fsdp_cpp")   # or any repository rule
    load("@fsdp_cpp//third_party:workspace.bzl", "fsdp_dependencies")
    fsdp_dependencies()

Each repository is declared only when the calling WORKSPACE has not declared one of that name
already, so a monorepo's own @rules_cc, @rules_java, @libtorch, ... win: declare them before the
call. Every in-tree path is resolved through a Label of this repository, never relative to the
calling workspace.

Repositories (all offline):
  @rules_cc               a stub forwarding @rules_cc's rules to the native ones (Bazel 4.2.3's
                          @bazel_tools loads it; Debian's bazel-rules-cc is too new for it).
  @remote_coverage_tools  a stub whose two tools exit 1 (every `bazel test` names it).
  @rules_java             Debian's bazel-rules-java (/usr/share/bazel/rules/java).
  @libtorch               LibTorch (third_party/libtorch/workspace.bzl).
  @mpi                    the system's Open MPI (third_party/mpi/workspace.bzl).
  @nlohmann_json          nlohmann/json, Debian's headers (third_party/json/workspace.bzl).
  @catch2                 Catch2 v2, Debian's headers (third_party/catch2/workspace.bzl).
  @torch_python           the Python that imports torch and safetensors, for tests
                          (third_party/python/workspace.bzl).
"""

load("//third_party/catch2:workspace.bzl", catch2 = "repo")
load("//third_party/json:workspace.bzl", nlohmann_json = "repo")
load("//third_party/libtorch:workspace.bzl", libtorch = "repo")
load("//third_party/mpi:workspace.bzl", mpi = "repo")
load("//third_party/python:workspace.bzl", torch_python = "repo")

# The Debian package bazel-rules-java installs the rules_java that Bazel 4.2.3 reads here.
_DEBIAN_RULES_JAVA = "/usr/share/bazel/rules/java"

def _in_tree_repository_impl(ctx):
    # The folder is found through a Label of this repository (its third_party/BUILD.bazel), so the
    # path is right whichever workspace declares the repository.
    anchor = ctx.path(ctx.attr.anchor)
    folder = anchor.dirname.get_child(ctx.attr.folder)
    if not folder.exists:
        fail("@%s: %s does not exist (expected beside %s)" % (ctx.name, folder, anchor))
    for entry in folder.readdir():
        ctx.symlink(entry, entry.basename)

_in_tree_repository = repository_rule(
    implementation = _in_tree_repository_impl,
    attrs = {
        "anchor": attr.label(mandatory = True, allow_single_file = True),
        "folder": attr.string(mandatory = True),
    },
    local = True,
    doc = "A repository whose files are a folder beside `anchor`, in this repository's tree.",
)

def _declared(name):
    return native.existing_rule(name) != None

def fsdp_dependencies():
    """Declares every repository the library needs that the calling WORKSPACE has not declared."""

    # Offline stand-ins for what Bazel 4.2.3 would otherwise download.
    if not _declared("rules_cc"):
        _in_tree_repository(
            name = "rules_cc",
            anchor = Label("//third_party:BUILD.bazel"),
            folder = "rules_cc_stub",
        )
    if not _declared("remote_coverage_tools"):
        _in_tree_repository(
            name = "remote_coverage_tools",
            anchor = Label("//third_party:BUILD.bazel"),
            folder = "remote_coverage_tools_stub",
        )
    if not _declared("rules_java"):
        native.local_repository(name = "rules_java", path = _DEBIAN_RULES_JAVA)
    if not _declared("libtorch"):
        libtorch()
    if not _declared("mpi"):
        mpi()
    if not _declared("nlohmann_json"):
        nlohmann_json()
    if not _declared("catch2"):
        catch2()
    if not _declared("torch_python"):
        torch_python()
