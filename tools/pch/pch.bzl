"""A GCC precompiled header of LibTorch's headers, built with each configuration's own flags.

Why: parsing <torch/torch.h> takes about 13 s and <ATen/ATen.h> 6 s on this project's 2-core
machines, most of every compile at -O0 (a 17 s compile of a test file spent 14 s parsing). A cold
`bazel test //...` compiles a few hundred such files, and the sanitizer build compiles the library
again: the precompiled header cuts each compile's parse to loading one file.

How: `torch_pch` runs the C++ toolchain's own compile command line (its features, the
configuration's --copt/--cxxopt and compilation mode, -fPIC except in opt mode, the deps' include
paths and defines) with `-x c++-header` on fsdp_cpp_torch_pch.h, and provides the header and its
.gch side by side in one include folder. tools/build_defs.bzl adds the target to every fsdp_cc_*
target's deps and `-include fsdp_cpp_torch_pch.h` to its copts: GCC looks for
fsdp_cpp_torch_pch.h.gch beside the header it finds and uses it when it was built with compatible
options (same -f/-O/-m flags, the same definitions of any macro the headers look at).

Why this is safe: when the .gch does not fit a compile (another compiler, other flags), GCC
includes fsdp_cpp_torch_pch.h as text and the compile is what it would have been, only slower;
`-Winvalid-pch` (in FSDP_COPTS) makes such a compile warn, so a lost speed-up shows in the build
log. What it changes: every translation unit sees LibTorch's C++ API declared before its first line,
so a missing #include of a LibTorch header does not fail the Bazel build (the CMake build, which
does not force the header, still would).
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _torch_pch_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    deps_info = cc_common.merge_cc_infos(cc_infos = [dep[CcInfo] for dep in ctx.attr.deps])
    deps_context = deps_info.compilation_context

    # The header and its precompiled form in one folder of their own: GCC pairs them by name and
    # folder (<header>.gch), Clang's driver by the path given to -include (<header>.pch).
    header = ctx.actions.declare_file(ctx.attr.name + "/" + ctx.file.hdr.basename)
    ctx.actions.symlink(output = header, target_file = ctx.file.hdr)
    clang = cc_toolchain.compiler == "clang"
    gch = ctx.actions.declare_file(header.basename + (".pch" if clang else ".gch"), sibling = header)

    # Clang: the templates the headers use are instantiated once, here, instead of at the end of
    # every translation unit (GCC does that in each compile: about 5 s of an 8.8 s compile of an
    # empty file with the header, measured); no modification times recorded, so a header restored
    # from Bazel's cache with another mtime does not invalidate the file.
    clang_flags = ["-fpch-instantiate-templates", "-Xclang", "-fno-pch-timestamp"] if clang else []

    variables = cc_common.create_compile_variables(
        feature_configuration = feature_configuration,
        cc_toolchain = cc_toolchain,
        user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts + ctx.attr.copts +
                             clang_flags + ["-x", "c++-header"],
        source_file = header.path,
        output_file = gch.path,
        include_directories = deps_context.includes,
        quote_include_directories = deps_context.quote_includes,
        system_include_directories = deps_context.system_includes,
        framework_include_directories = deps_context.framework_includes,
        preprocessor_defines = deps_context.defines,
        # Position-independent code as the configuration's compiles. GCC: PIC everywhere except in
        # opt mode, where Bazel compiles a binary's objects without -fPIC (GCC's default -fpie),
        # and a .gch built with -fPIC would be refused ("created and used with different settings
        # of -fpie") by every compile of the benchmark programs; in opt mode, the objects of
        # dynamically linked tests (PIC) then compile without the header. Clang refuses a
        # mismatched .pch with an error ("is pie differs in PCH file"), not a fallback: this
        # workspace builds with --force_pic (.bazelrc), so every object is PIC in every mode, as
        # the header; a workspace that compiles the library with Clang at -c opt needs it too.
        use_pic = clang or ctx.var["COMPILATION_MODE"] != "opt",
    )
    action = "c++-compile"
    ctx.actions.run(
        executable = cc_common.get_tool_for_action(
            feature_configuration = feature_configuration,
            action_name = action,
        ),
        arguments = cc_common.get_memory_inefficient_command_line(
            feature_configuration = feature_configuration,
            action_name = action,
            variables = variables,
        ),
        env = cc_common.get_environment_variables(
            feature_configuration = feature_configuration,
            action_name = action,
            variables = variables,
        ),
        inputs = depset([header], transitive = [deps_context.headers, cc_toolchain.all_files]),
        outputs = [gch],
        mnemonic = "CppPrecompileHeader",
        progress_message = "Precompiling %s" % ctx.file.hdr.short_path,
    )
    own = CcInfo(compilation_context = cc_common.create_compilation_context(
        headers = depset([header, gch]),
        includes = depset([header.dirname]),
    ))
    return [
        DefaultInfo(files = depset([header, gch])),
        cc_common.merge_cc_infos(direct_cc_infos = [own], cc_infos = [deps_info]),
    ]

torch_pch = rule(
    implementation = _torch_pch_impl,
    attrs = {
        "hdr": attr.label(allow_single_file = [".h"], mandatory = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    incompatible_use_toolchain_transition = True,
)
