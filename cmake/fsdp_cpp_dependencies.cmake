# The outside libraries of fsdp-cpp as CMake sees them: the same pieces, defines and link lines as
# the Bazel build's third_party/ (third_party/libtorch/libtorch.BUILD.tpl, third_party/mpi,
# third_party/json, third_party/fmt, third_party/catch2). Included by the root CMakeLists.txt and
# by the installed fsdp_cppConfig.cmake, so an installed prefix recomputes them on the machine that
# uses it (nothing of the build machine's paths is baked into the exported targets).
#
#   fsdp_cpp_torch_search_paths()     LibTorch's location when none was given: LIBTORCH_HOME (an
#                                     official LibTorch zip, as in the Bazel build), else the torch
#                                     package of the project's Python (FSDP_PYTHON, else
#                                     $FSDP_VENV or ~/.cache/fsdp_cpp/venv, else python3), appended
#                                     to CMAKE_PREFIX_PATH, so Torch_DIR / CMAKE_PREFIX_PATH win.
#   fsdp_cpp_define_dependency_targets()   after find_package(Torch), MPI (CXX, MPI_CXX_SKIP_MPICXX)
#                                     and nlohmann_json: the targets the Bazel labels map to:
#     @libtorch//:headers  fsdp_cpp_ext::torch_headers  (-isystem include dirs, USE_DISTRIBUTED)
#     @libtorch//:c10      fsdp_cpp_ext::c10            (libc10)
#     @libtorch//:torch_cpu fsdp_cpp_ext::torch_cpu     (libtorch_cpu, libtorch, libc10)
#     @libtorch//:torch_cuda fsdp_cpp_ext::torch_cuda   (libtorch_cuda + libc10_cuda, --no-as-needed;
#                                     the CUDA runtime and nccl.h of the wheel's nvidia-* packages;
#                                     USE_C10D_NCCL), only when LibTorch has libtorch_cuda
#     @mpi                 fsdp_cpp_ext::mpi            (MPI::MPI_CXX without the C++ bindings:
#                                                        OMPI_SKIP_MPICXX)
#     //third_party/json   fsdp_cpp_ext::json           (nlohmann_json::nlohmann_json)
#     //third_party/fmt    fsdp_cpp_ext::fmt            (LibTorch's bundled fmt, FMT_HEADER_ONLY)
#     //third_party/catch2 fsdp_cpp_ext::catch2         (Catch2::Catch2, tests only)
#
# Link lines use LibTorch's library files, not TorchConfig's `torch` target: that target also links
# libtorch_cuda, the CUDA toolkit's nvrtc and (as compile definitions) USE_C10D_GLOO, USE_RPC,
# USE_TENSORPIPE, none of which the Bazel build has. The include folders are TORCH_INCLUDE_DIRS and
# the flags TORCH_CXX_FLAGS (-D_GLIBCXX_USE_CXX11_ABI=0 for a pre-cxx11-ABI LibTorch zip; empty for
# the torch wheels since 2.7, which use the C++11 ABI, as Bazel's default does).

function(fsdp_cpp_torch_search_paths)
  if(Torch_DIR OR DEFINED ENV{Torch_DIR})
    return()
  endif()
  set(paths "")
  if(DEFINED ENV{LIBTORCH_HOME} AND NOT "$ENV{LIBTORCH_HOME}" STREQUAL "")
    list(APPEND paths "$ENV{LIBTORCH_HOME}")
  endif()
  set(python "${FSDP_PYTHON}")
  if(NOT python)
    if(DEFINED ENV{FSDP_VENV} AND NOT "$ENV{FSDP_VENV}" STREQUAL "")
      set(venv "$ENV{FSDP_VENV}")
    else()
      set(venv "$ENV{HOME}/.cache/fsdp_cpp/venv")
    endif()
    if(EXISTS "${venv}/bin/python")
      set(python "${venv}/bin/python")
    else()
      find_program(python NAMES python3)
    endif()
  endif()
  if(python)
    execute_process(
      COMMAND "${python}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE rc ERROR_QUIET)
    if(rc EQUAL 0 AND prefix)
      list(APPEND paths "${prefix}")
    endif()
  endif()
  set(CMAKE_PREFIX_PATH ${CMAKE_PREFIX_PATH} ${paths} PARENT_SCOPE)
endfunction()

function(_fsdp_cpp_first_existing out base)
  foreach(rel IN LISTS ARGN)
    if(EXISTS "${base}/${rel}")
      get_filename_component(abs "${base}/${rel}" REALPATH)
      set(${out} "${abs}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

function(fsdp_cpp_define_dependency_targets)
  if(TARGET fsdp_cpp_ext::torch_cpu)
    return()
  endif()
  # GLOBAL in the project's own build, so that a parent project using add_subdirectory sees them.
  set(global "")
  if(FSDP_CPP_FROM_SOURCE_TREE)
    set(global GLOBAL)
  endif()

  # ---- LibTorch
  if(NOT TORCH_INSTALL_PREFIX OR NOT TORCH_INCLUDE_DIRS)
    message(FATAL_ERROR "fsdp_cpp: find_package(Torch) did not set TORCH_INSTALL_PREFIX / TORCH_INCLUDE_DIRS")
  endif()
  set(torch_lib "${TORCH_INSTALL_PREFIX}/lib")
  foreach(lib torch_cpu torch c10)
    if(NOT EXISTS "${torch_lib}/lib${lib}.so")
      message(FATAL_ERROR "fsdp_cpp: ${torch_lib}/lib${lib}.so not found (is ${TORCH_INSTALL_PREFIX} a LibTorch?)")
    endif()
  endforeach()
  separate_arguments(torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  add_library(fsdp_cpp_ext::torch_headers INTERFACE IMPORTED ${global})
  set_target_properties(fsdp_cpp_ext::torch_headers PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
    INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED"
    INTERFACE_COMPILE_OPTIONS "${torch_flags}")
  add_library(fsdp_cpp_ext::c10 INTERFACE IMPORTED ${global})
  set_target_properties(fsdp_cpp_ext::c10 PROPERTIES
    INTERFACE_LINK_LIBRARIES "fsdp_cpp_ext::torch_headers;${torch_lib}/libc10.so")
  add_library(fsdp_cpp_ext::torch_cpu INTERFACE IMPORTED ${global})
  set_target_properties(fsdp_cpp_ext::torch_cpu PROPERTIES
    INTERFACE_LINK_LIBRARIES
      "fsdp_cpp_ext::torch_headers;${torch_lib}/libtorch_cpu.so;${torch_lib}/libtorch.so;${torch_lib}/libc10.so")
  add_library(fsdp_cpp_ext::fmt INTERFACE IMPORTED ${global})
  set_target_properties(fsdp_cpp_ext::fmt PROPERTIES
    INTERFACE_COMPILE_DEFINITIONS "FMT_HEADER_ONLY"
    INTERFACE_LINK_LIBRARIES "fsdp_cpp_ext::torch_headers")

  # CUDA pieces, as third_party/libtorch/workspace.bzl finds them: the nvidia-* wheels beside torch
  # (CUDA 13, then 12), else /usr/local/cuda.
  if(EXISTS "${torch_lib}/libtorch_cuda.so")
    _fsdp_cpp_first_existing(cuda_inc "${TORCH_INSTALL_PREFIX}" ../nvidia/cu13/include ../nvidia/cuda_runtime/include)
    _fsdp_cpp_first_existing(nccl_inc "${TORCH_INSTALL_PREFIX}" ../nvidia/nccl/include)
    _fsdp_cpp_first_existing(cudart_dir "${TORCH_INSTALL_PREFIX}" ../nvidia/cu13/lib ../nvidia/cuda_runtime/lib)
    if(NOT cuda_inc)
      set(cuda_inc /usr/local/cuda/include)
    endif()
    if(NOT nccl_inc)
      set(nccl_inc /usr/local/cuda/include)
    endif()
    if(NOT cudart_dir)
      set(cudart_dir /usr/local/cuda/lib64)
    endif()
    file(GLOB cudart "${cudart_dir}/libcudart.so*")
    list(SORT cudart)
    set(cuda_link "-Wl,--no-as-needed,${torch_lib}/libtorch_cuda.so,${torch_lib}/libc10_cuda.so,--as-needed")
    if(cudart)
      list(GET cudart 0 cudart)
      list(APPEND cuda_link "-Wl,-rpath,${cudart_dir}" "${cudart}")
    endif()
    add_library(fsdp_cpp_ext::torch_cuda INTERFACE IMPORTED ${global})
    set_target_properties(fsdp_cpp_ext::torch_cuda PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${cuda_inc};${nccl_inc}"
      INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${cuda_inc};${nccl_inc}"
      INTERFACE_COMPILE_DEFINITIONS "USE_C10D_NCCL"
      INTERFACE_LINK_LIBRARIES "fsdp_cpp_ext::torch_cpu;${cuda_link}")
  endif()

  # ---- Open MPI (any MPI; the Bazel build asks mpicc --showme, FindMPI asks the same wrapper). The
  # C library only, as Bazel's -lmpi: FindMPI's CXX component also lists Open MPI's libmpi_cxx.
  set(mpi_libs "${MPI_CXX_LIBRARIES}")
  list(FILTER mpi_libs EXCLUDE REGEX "mpi_cxx")
  add_library(fsdp_cpp_ext::mpi INTERFACE IMPORTED ${global})
  set_target_properties(fsdp_cpp_ext::mpi PROPERTIES
    INTERFACE_COMPILE_DEFINITIONS "OMPI_SKIP_MPICXX;MPICH_SKIP_MPICXX"
    INTERFACE_INCLUDE_DIRECTORIES "${MPI_CXX_INCLUDE_DIRS}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${MPI_CXX_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "${mpi_libs}")

  # ---- nlohmann/json (header-only)
  add_library(fsdp_cpp_ext::json INTERFACE IMPORTED ${global})
  get_target_property(json_inc nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
  get_target_property(json_defs nlohmann_json::nlohmann_json INTERFACE_COMPILE_DEFINITIONS)
  if(json_inc)
    set_target_properties(fsdp_cpp_ext::json PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${json_inc}")
  endif()
  if(json_defs)
    set_target_properties(fsdp_cpp_ext::json PROPERTIES INTERFACE_COMPILE_DEFINITIONS "${json_defs}")
  endif()

  # ---- Catch2 v2 (tests only)
  if(TARGET Catch2::Catch2)
    add_library(fsdp_cpp_ext::catch2 INTERFACE IMPORTED ${global})
    get_target_property(catch_inc Catch2::Catch2 INTERFACE_INCLUDE_DIRECTORIES)
    set_target_properties(fsdp_cpp_ext::catch2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${catch_inc}")
  endif()
endfunction()
