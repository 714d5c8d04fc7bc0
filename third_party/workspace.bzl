"""Every external dependency of the project, declared in one place (loaded by WORKSPACE)."""

load("//third_party/libtorch:workspace.bzl", libtorch = "repo")
load("//third_party/mpi:workspace.bzl", mpi = "repo")
load("//third_party/python:workspace.bzl", torch_python = "repo")

def fsdp_dependencies():
    # Offline stand-ins for what Bazel 4.2.3 would otherwise download.
    native.local_repository(name = "rules_cc", path = "third_party/rules_cc_stub")
    native.local_repository(name = "remote_coverage_tools", path = "third_party/remote_coverage_tools_stub")
    native.local_repository(name = "rules_java", path = "/usr/share/bazel/rules/java")
    libtorch()
    mpi()
    torch_python()
