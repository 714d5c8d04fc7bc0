// The CMake build's holder of the precompiled LibTorch headers (cmake/fsdp_cpp_rules.cmake,
// fsdp_cpp_define_torch_pch): CMake precompiles a target's headers only for a target with a
// source, and every other target that uses LibTorch reuses this one's.
