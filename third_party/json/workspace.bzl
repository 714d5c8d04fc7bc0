"""Declares @nlohmann_json: nlohmann/json from Debian's nlohmann-json3-dev (/usr/include/nlohmann)."""

load("//third_party:system_headers.bzl", "system_headers_repository")

def repo():
    # @nlohmann_json//:json, the name the library has in the Bazel Central Registry, so a monorepo
    # that declares its own @nlohmann_json first serves //third_party/json as well.
    system_headers_repository(
        name = "nlohmann_json",
        folder = "nlohmann",
        package = "nlohmann-json3-dev",
        target = "json",
    )
