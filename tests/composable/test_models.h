#pragma once
// Models used by the fully_shard tests, written as a user would: LibTorch modules opted into
// forward hooks with one line each, children called through their holders.

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/hookable_module_holder.h"
#include "fsdp_cpp/contract/hookable_module_list.h"
#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/contract/hookable_sequential.h"

namespace fsdp::testing {

/// x + fc2(relu(fc1(x)))
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", contract::Linear(dim, hidden));
    fc2 = register_module("fc2", contract::Linear(hidden, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::relu(fc1(x))); }
  contract::Linear fc1{nullptr}, fc2{nullptr};
};
FSDP_HOOKABLE_MODULE(MlpBlock);

/// in -> blocks -> head
struct MlpStackImpl : torch::nn::Module {
  MlpStackImpl(int64_t in_dim, int64_t dim, int64_t hidden, int64_t depth, int64_t out_dim) {
    in = register_module("in", contract::Linear(in_dim, dim));
    blocks = register_module("blocks", contract::ModuleList());
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(MlpBlock(dim, hidden));
    head = register_module("head", contract::Linear(dim, out_dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (const auto& block : *blocks) x = block.forward<torch::Tensor>(x);
    return head(x);
  }
  MlpBlock block(size_t i) const { return blocks->at<MlpBlock>(i); }
  contract::Linear in{nullptr}, head{nullptr};
  contract::ModuleList blocks{nullptr};
};
FSDP_HOOKABLE_MODULE(MlpStack);

/// Seq(Lin(8,4), Seq(Lin(4,16), Lin(16,16)), Lin(16,4), Lin(4,8)), with a ReLU after the inner Seq.
inline contract::Sequential make_nested_sequential() {
  return contract::Sequential(contract::Linear(8, 4),
                              contract::Sequential(contract::Linear(4, 16), contract::Linear(16, 16)),
                              contract::Linear(16, 4), contract::Linear(4, 8));
}

/// Parameters smaller than the world size: Linear(3,3), then Linear(1,1) on the row sums.
struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    a = register_module("a", contract::Linear(3, 3));
    b = register_module("b", contract::Linear(1, 1));
  }
  torch::Tensor forward(torch::Tensor x) { return b(torch::tanh(a(x)).sum(-1, true)); }
  contract::Linear a{nullptr}, b{nullptr};
};
FSDP_HOOKABLE_MODULE(Tiny);

/// fc(x) when `use_fc`, else x * 2: with `use_fc` false its parameters get no gradient although
/// its output does.
struct GateImpl : torch::nn::Module {
  explicit GateImpl(int64_t dim) { fc = register_module("fc", contract::Linear(dim, dim)); }
  torch::Tensor forward(torch::Tensor x, bool use_fc) { return use_fc ? fc(x) : x * 2; }
  contract::Linear fc{nullptr};
};
FSDP_HOOKABLE_MODULE(Gate);

/// v(gate(w(x), use_gate_fc))
struct BranchImpl : torch::nn::Module {
  explicit BranchImpl(int64_t dim) {
    w = register_module("w", contract::Linear(dim, dim));
    gate = register_module("gate", Gate(dim));
    v = register_module("v", contract::Linear(dim, dim));
  }
  torch::Tensor forward(torch::Tensor x, bool use_gate_fc) { return v(gate(w(x), use_gate_fc)); }
  contract::Linear w{nullptr};
  Gate gate{nullptr};
  contract::Linear v{nullptr};
};
FSDP_HOOKABLE_MODULE(Branch);

/// Hook-able ReLU: a parameter-free module.
FSDP_HOOKABLE_MODULE_IMPL(ReLU, torch::nn::ReLUImpl);

/// head(relu(shared(relu(shared(x))))): `shared` runs twice in one forward.
struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(int64_t dim) {
    shared = register_module("shared", contract::Linear(dim, dim));
    act = register_module("act", ReLU());
    head = register_module("head", contract::Linear(dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) { return head(act(shared(act(shared(x))))); }
  contract::Linear shared{nullptr};
  ReLU act{nullptr};
  contract::Linear head{nullptr};
};
FSDP_HOOKABLE_MODULE(Twice);

/// c(relu(b(relu(a(x))))): a and b form one unit of siblings.
struct SiblingsImpl : torch::nn::Module {
  explicit SiblingsImpl(int64_t dim) {
    a = register_module("a", contract::Linear(dim, 2 * dim));
    b = register_module("b", contract::Linear(2 * dim, dim));
    c = register_module("c", contract::Linear(dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    return c(torch::relu(b(torch::relu(a(x)))));
  }
  contract::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
FSDP_HOOKABLE_MODULE(Siblings);

/// x @ weight, where `weight` is a tensor registered elsewhere too (a tied projection).
struct ProjectionImpl : torch::nn::Module {
  explicit ProjectionImpl(torch::Tensor tied) { weight = register_parameter("weight", tied); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight); }
  torch::Tensor weight;
};
FSDP_HOOKABLE_MODULE(Projection);

/// proj(relu(mid(enc(x)))) with proj.weight == enc.weight (tied, like an embedding and the output
/// projection of a language model).
struct TiedImpl : torch::nn::Module {
  TiedImpl(int64_t in, int64_t hidden) {
    enc = register_module("enc", contract::Linear(in, hidden));
    mid = register_module("mid", contract::Linear(hidden, hidden));
    proj = register_module("proj", Projection(enc->weight));
  }
  torch::Tensor forward(torch::Tensor x) { return proj(torch::relu(mid(enc(x)))); }
  contract::Linear enc{nullptr}, mid{nullptr};
  Projection proj{nullptr};
};
FSDP_HOOKABLE_MODULE(Tied);

/// b(a(x)), or a(b(x)) when `swap`: the order of two units depends on the caller.
struct OrderImpl : torch::nn::Module {
  explicit OrderImpl(int64_t dim) {
    a = register_module("a", contract::Linear(dim, dim));
    b = register_module("b", contract::Linear(dim, dim));
  }
  torch::Tensor forward(torch::Tensor x, bool swap) { return swap ? a(b(x)) : b(a(x)); }
  contract::Linear a{nullptr}, b{nullptr};
};
FSDP_HOOKABLE_MODULE(Order);

/// A Linear with a buffer (like normalisation statistics).
struct WithBufferImpl : torch::nn::Module {
  explicit WithBufferImpl(int64_t dim) {
    fc = register_module("fc", contract::Linear(dim, dim));
    running = register_buffer("running", torch::randn({dim}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x) + running; }
  contract::Linear fc{nullptr};
  torch::Tensor running;
};
FSDP_HOOKABLE_MODULE(WithBuffer);

/// logits = x @ weight^T with `weight` registered here too: the output projection tied to the
/// token embedding.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor tied) { weight = register_parameter("weight", tied); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight.t()); }
  torch::Tensor weight;
};
FSDP_HOOKABLE_MODULE(TiedHead);

/// Pre-LayerNorm transformer block on [time, batch, d]: MultiheadAttention with a causal mask,
/// then a GELU MLP.
struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t d, int64_t heads) {
    ln1 = register_module("ln1", contract::LayerNorm(torch::nn::LayerNormOptions({d})));
    attn = register_module("attn", contract::MultiheadAttention(d, heads));
    ln2 = register_module("ln2", contract::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", contract::Linear(d, 4 * d));
    fc2 = register_module("fc2", contract::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor causal_mask) {
    torch::Tensor h = ln1(x);
    auto attended = attn(h, h, h, torch::Tensor(), false, causal_mask);
    x = x + std::get<0>(attended);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  contract::LayerNorm ln1{nullptr}, ln2{nullptr};
  contract::MultiheadAttention attn{nullptr};
  contract::Linear fc1{nullptr}, fc2{nullptr};
};
FSDP_HOOKABLE_MODULE(TransformerBlock);

/// A small GPT: token embedding tied to the output projection, learned positions, transformer
/// blocks, final LayerNorm. tokens [batch, time] -> logits [batch, time, vocab].
struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(int64_t vocab, int64_t context, int64_t d, int64_t heads, int64_t layers) {
    tok = register_module("tok", contract::Embedding(torch::nn::EmbeddingOptions(vocab, d)));
    pos = register_parameter("pos", torch::randn({context, d}) * 0.02);
    blocks = register_module("blocks", contract::ModuleList());
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(TransformerBlock(d, heads));
    ln_f = register_module("ln_f", contract::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", TiedHead(tok->weight));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    const int64_t T = tokens.size(1);
    torch::Tensor x = (tok(tokens) + pos.narrow(0, 0, T)).transpose(0, 1);
    torch::Tensor mask = torch::ones({T, T}, torch::kBool).triu(1);
    for (const auto& block : *blocks) x = block.forward<torch::Tensor>(x, mask);
    return head(ln_f(x).transpose(0, 1));
  }
  TransformerBlock block(size_t i) const { return blocks->at<TransformerBlock>(i); }
  contract::Embedding tok{nullptr};
  torch::Tensor pos;
  contract::ModuleList blocks{nullptr};
  contract::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};
};
FSDP_HOOKABLE_MODULE(TinyGpt);

}  // namespace fsdp::testing
