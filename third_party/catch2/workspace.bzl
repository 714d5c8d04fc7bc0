"""Declares @catch2: Catch2 v2 from Debian's catch2 package (/usr/include/catch2/catch.hpp)."""

load("//third_party:system_headers.bzl", "system_headers_repository")

def repo():
    system_headers_repository(
        name = "catch2",
        folder = "catch2",
        package = "catch2",
        target = "catch2",
    )
