#include "fsdp_cpp/tools/bench/bench_models.h"

#include <fstream>
#include <iterator>

#include <ATen/ops/tanh.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

namespace fsdp::bench {

TinyBlockImpl::TinyBlockImpl(int64_t dim) {
  fc = register_module("fc", contract::Linear(dim, dim));
}

at::Tensor TinyBlockImpl::forward(at::Tensor x) { return x + at::tanh(fc(x)); }

TinyNetImpl::TinyNetImpl(int64_t dim, int64_t depth) {
  blocks = register_module("blocks", contract::ModuleList());
  for (int64_t i = 0; i < depth; ++i) blocks->push_back(TinyBlock(dim));
}

at::Tensor TinyNetImpl::forward(at::Tensor x) {
  for (const auto& block : *blocks) x = block.forward<at::Tensor>(x);
  return x;
}

void save_tensor_file(const std::string& path, const TensorMap& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t.contiguous());
  const std::vector<char> bytes = torch::pickle_save(dict);
  std::ofstream out(path, std::ios::binary);
  TORCH_CHECK(out, "cannot write ", path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(out.good(), "writing ", path, " failed");
}

TensorMap load_tensor_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read ", path, " (write it with fsdp_bench --write-init ", path, ")");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue value = torch::pickle_load(bytes);
  TORCH_CHECK(value.isGenericDict(), path, ": expected a dict of tensors");
  TensorMap tensors;
  for (const auto& entry : value.toGenericDict()) {
    tensors[entry.key().toStringRef()] = entry.value().toTensor();
  }
  return tensors;
}

void load_parameters(torch::nn::Module& module, const TensorMap& tensors, const std::string& prefix) {
  c10::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    const std::string name = prefix + item.key();
    auto it = tensors.find(name);
    TORCH_CHECK(it != tensors.end(), "init file has no tensor '", name, "'");
    TORCH_CHECK(it->second.sizes() == item.value().sizes() &&
                    it->second.scalar_type() == item.value().scalar_type(),
                "init file: '", name, "' is ", it->second.scalar_type(), " ", it->second.sizes(),
                ", the model's is ", item.value().scalar_type(), " ", item.value().sizes());
    item.value().copy_(it->second);
  }
}

void store_parameters(const torch::nn::Module& module, TensorMap& tensors, const std::string& prefix) {
  for (const auto& item : module.named_parameters()) {
    tensors[prefix + item.key()] = item.value().detach().clone();
  }
}

}  // namespace fsdp::bench
