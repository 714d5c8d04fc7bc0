#pragma once
// Models with tied parameters (one tensor registered by several modules) for the tied-parameter
// tests: every module arrangement a shared weight can take across units. Each maps [rows, in] to
// [rows, in]: the tied weight W [hidden, in] encodes (x W^T) and decodes (x W) again.

#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/hookable_modules.h"
#include "fsdp_cpp/tests/composable/test_models.h"

namespace fsdp::testing {

/// x W^T with W registered here too (no bias): the transpose use of a tied weight.
struct TiedEncoderImpl : torch::nn::Module {
  explicit TiedEncoderImpl(torch::Tensor tied) { weight = register_parameter("weight", tied); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(weight.t()); }
  torch::Tensor weight;
};
FSDP_HOOKABLE_MODULE(TiedEncoder);

/// head(relu(body(emb(x)))), head.weight == emb.weight: the embedding tied to the output
/// projection, each of emb, body and head a module of its own (siblings under the root).
struct TiedSiblingsImpl : torch::nn::Module {
  TiedSiblingsImpl(int64_t in, int64_t hidden) {
    emb = register_module("emb", contract::Linear(in, hidden));
    body = register_module("body", MlpBlock(hidden, 2 * hidden));
    head = register_module("head", Projection(emb->weight));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(body(emb(x)))); }
  contract::Linear emb{nullptr};
  MlpBlock body{nullptr};
  Projection head{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedSiblings);

/// A unit and its parent sharing a weight: `inner.enc` uses W, and so does `inner` itself
/// (x W, registered directly on it), inside a root with layers of its own.
struct TiedInnerImpl : torch::nn::Module {
  explicit TiedInnerImpl(int64_t dim) {
    enc = register_module("enc", contract::Linear(dim, dim));
    mix = register_module("mix", contract::Linear(dim, dim));
    w = register_parameter("w", enc->weight);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(mix(enc(x))).matmul(w); }
  contract::Linear enc{nullptr}, mix{nullptr};
  torch::Tensor w;
};
FSDP_HOOKABLE_MODULE(TiedInner);

/// out(inner(pre(x))).
struct TiedParentImpl : torch::nn::Module {
  TiedParentImpl(int64_t in, int64_t dim) {
    pre = register_module("pre", contract::Linear(in, dim));
    inner = register_module("inner", TiedInner(dim));
    out = register_module("out", contract::Linear(dim, in));
  }
  torch::Tensor forward(torch::Tensor x) { return out(inner(torch::relu(pre(x)))); }
  contract::Linear pre{nullptr}, out{nullptr};
  TiedInner inner{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedParent);

/// Three modules beside `emb` use emb.weight: dec (x W), enc2 (x W^T) and head (x W).
/// head(relu(enc2(relu(dec(relu(emb(x))))))).
struct TiedThreeWayImpl : torch::nn::Module {
  TiedThreeWayImpl(int64_t in, int64_t hidden) {
    emb = register_module("emb", contract::Linear(in, hidden));
    dec = register_module("dec", Projection(emb->weight));
    enc2 = register_module("enc2", TiedEncoder(emb->weight));
    head = register_module("head", Projection(emb->weight));
  }
  torch::Tensor forward(torch::Tensor x) {
    return head(torch::relu(enc2(torch::relu(dec(torch::relu(emb(x)))))));
  }
  contract::Linear emb{nullptr};
  Projection dec{nullptr};
  TiedEncoder enc2{nullptr};
  Projection head{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedThreeWay);

/// relu(b(relu(a(x)))) with b.weight == a.weight (b decodes what a encodes).
struct TiedPairImpl : torch::nn::Module {
  TiedPairImpl(int64_t in, int64_t hidden) {
    a = register_module("a", contract::Linear(in, hidden));
    b = register_module("b", Projection(a->weight));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(b(torch::relu(a(x)))); }
  contract::Linear a{nullptr};
  Projection b{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedPair);

/// c(pair(x)) + x, where c.weight == pair.a.weight too (when `tie_outside`): the shared weight is
/// used inside `pair` twice and, optionally, once outside it.
struct TiedNestedImpl : torch::nn::Module {
  TiedNestedImpl(int64_t in, int64_t hidden, bool tie_outside) {
    pair = register_module("pair", TiedPair(in, hidden));
    c = register_module("c", contract::Linear(in, in));
    if (tie_outside) {
      out = register_module("out", TiedEncoder(pair->a->weight));
      back = register_module("back", Projection(pair->a->weight));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor y = c(pair(x)) + x;
    if (out) y = back(torch::relu(out(y)));
    return y;
  }
  TiedPair pair{nullptr};
  contract::Linear c{nullptr};
  TiedEncoder out{nullptr};
  Projection back{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedNested);

/// holder.proj(x) = x W: a module holding a tied projection one level down.
struct TiedHolderImpl : torch::nn::Module {
  explicit TiedHolderImpl(torch::Tensor tied) { proj = register_module("proj", Projection(tied)); }
  torch::Tensor forward(torch::Tensor x) { return proj(x); }
  Projection proj{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedHolder);

/// pair(x) + y(relu(pair.a(x))), with pair.a.weight used by pair.a, pair.b and y.proj: for a unit
/// of the siblings pair.a and y.proj, which spans two subtrees.
struct TiedAcrossImpl : torch::nn::Module {
  TiedAcrossImpl(int64_t in, int64_t hidden) {
    pair = register_module("pair", TiedPair(in, hidden));
    y = register_module("y", TiedHolder(pair->a->weight));
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor first = pair(x);
    return first + y(torch::relu(pair->a(x)));
  }
  TiedPair pair{nullptr};
  TiedHolder y{nullptr};
};
FSDP_HOOKABLE_MODULE(TiedAcross);

}  // namespace fsdp::testing
