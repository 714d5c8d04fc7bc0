// The headers every compile of the project parses first, precompiled once per build configuration
// (//tools/pch:torch_pch, tools/pch/pch.bzl) and forced into each translation unit of the
// fsdp_cc_* macros with `-include`: LibTorch's C++ API headers take 6-13 s to parse, most of a
// compile at -O0. See tools/pch/pch.bzl for why this is safe.

#include <torch/torch.h>
// What the communicator and the engine's autograd parts include (about 0.5 s more to parse).
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
