"""Reference values from Hugging Face transformers for the C++ Qwen3-MoE model (models/moe.h), on the
CPU in float32.

  moe_reference.py make OUT --variant qwen3|deepseek
      qwen3:    a tiny random Qwen3MoeForCausalLM (8 experts, top-2, norm_topk_prob, 4 layers,
                hidden 32, vocabulary 101, output_router_logits with router_aux_loss_coef 0.1).
      deepseek: the same with layer 0 dense (mlp_only_layers) and every other layer's block replaced
                by transformers' DeepseekV3MoE (sigmoid scores, e_score_correction_bias, 4 groups of
                which 2 eligible, routed_scaling_factor 2.5, one shared expert); its bias updated
                after every step by rate 0.01 x sign(mean load - load), load counted over the batch.
      OUT/hf/   config.json (the DeepSeek options under DeepSeek-V3's keys) and model.safetensors in
                the saved, one-module-per-expert layout
      OUT/reference.safetensors
          input_ids [B, T], labels [B, T] (-100 label padding, uneven over rows); rows 6-11 hold one
          token repeated, so every token of those rows routes alike (on a data rank holding only
          them, most experts get no row); logits of the initial model; routing.ids.<layer> and
          routing.weights.<layer> [B*T, k] of the initial model (ids ascending per token);
          for each split k in 1, 2, 3, 4 of the batch into k equal chunks of rows (data ranks x
          microbatches, in order): aux.k<k> [k] (load_balancing_loss_func of each chunk's router
          logits), loss.k<k> = cross-entropy (mean over counted labels) + coef x sum_j (n_j / N)
          aux_j, grad.k<k>.<fqn> of every parameter, and after 3 AdamW steps (lr 1e-2, weight decay
          0.1, eps 1e-6) on that loss: trained.k<k>.<fqn> (parameters and buffers), trained_logits.k<k>.
          FQNs are the saved (per-expert) ones.
  moe_reference.py check OUT EXPORTED K [CPP_LOGITS]
      loads EXPORTED (the C++ side's export after its 3 steps at split K) in transformers (qwen3:
      AutoModelForCausalLM.from_pretrained; deepseek: the same hybrid built from its config.json,
      the files loaded by name) and checks its parameters and logits against trained.k<K> (and the
      C++ side's logits when given). Exit 1 on a mismatch.

  moe_reference.py batch LIST
      the commands of LIST (one per line, this script's arguments) in one process
      (tests/models/reference_batch.py).

Nothing is downloaded: the configs are built here.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

B, T = 12, 16
LR, WD, STEPS = 1e-2, 0.1, 3
# AdamW's eps: 1e-6, not 1e-8, so that an expert weight whose gradient is ~0 (few rows, cancelling
# terms) and differs by rounding cannot swing its update by up to lr (Adam divides by |grad| + eps).
EPS = 1e-6
SPLITS = (1, 2, 3, 4)
COEF = 0.1
BIAS_RATE = 0.01
DEEPSEEK = {"scoring_func": "sigmoid", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "n_shared_experts": 1, "router_bias_update_rate": BIAS_RATE}


def qwen3_config(variant):
    from transformers import Qwen3MoeConfig
    extra = dict(DEEPSEEK) if variant == "deepseek" else {}
    config = Qwen3MoeConfig(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            output_router_logits=True, router_aux_loss_coef=COEF,
                            mlp_only_layers=[0] if variant == "deepseek" else [], **extra)
    return config


def build(config):
    """Qwen3MoeForCausalLM, its sparse blocks replaced by DeepseekV3MoE when config.scoring_func is
    sigmoid. Experts run transformers' eager loop (one expert at a time)."""
    from transformers import Qwen3MoeForCausalLM
    config._experts_implementation = "eager"
    model = Qwen3MoeForCausalLM(config)
    if getattr(config, "scoring_func", "softmax") == "sigmoid":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        ds = DeepseekV3Config(hidden_size=config.hidden_size, moe_intermediate_size=config.moe_intermediate_size,
                              n_routed_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                              n_group=config.n_group, topk_group=config.topk_group,
                              norm_topk_prob=config.norm_topk_prob,
                              routed_scaling_factor=config.routed_scaling_factor,
                              n_shared_experts=config.n_shared_experts, hidden_act="silu")
        ds._experts_implementation = "eager"
        for i, layer in enumerate(model.model.layers):
            if i not in config.mlp_only_layers:
                layer.mlp = DeepseekV3MoE(ds)
    return model


def routers(model):
    """(layer index, router module) of every sparse layer."""
    out = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k"):
            out.append((i, layer.mlp.gate))
    return out


def per_expert(named):
    """Saved names: mlp.experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I] split per expert."""
    out = {}
    for name, t in named.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def fused(named, model):
    """The inverse of per_expert for `model`'s state dict keys."""
    out = {}
    for key in model.state_dict():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            n = sum(1 for k in named if k.startswith(prefix) and k.endswith(".down_proj.weight"))
            out[key] = torch.stack([torch.cat([named[f"{prefix}{e}.gate_proj.weight"],
                                               named[f"{prefix}{e}.up_proj.weight"]]) for e in range(n)])
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            n = sum(1 for k in named if k.startswith(prefix) and k.endswith(".down_proj.weight"))
            out[key] = torch.stack([named[f"{prefix}{e}.down_proj.weight"] for e in range(n)])
        else:
            out[key] = named[key]
    return out


def batch(vocab):
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, vocab, (B, T), generator=g)
    input_ids[6:] = 7  # every token of rows 6-11 routes alike
    labels = torch.roll(input_ids, -1, 1).clone()
    for r in range(B):
        k = r % 5
        if k:
            labels[r, T - k:] = -100
    return input_ids, labels


class Recorder:
    """Each router's outputs of the latest forward: (logits, weights, ids) per sparse layer."""

    def __init__(self, model):
        self.out = {}
        for i, router in routers(model):
            router.register_forward_hook(lambda m, args, output, i=i: self.out.__setitem__(i, output))

    def logits(self):
        return tuple(self.out[i][0] for i in sorted(self.out))


def forward(model, input_ids):
    return model(input_ids=input_ids, output_router_logits=False).logits


def loss_of(model, recorder, input_ids, labels, k):
    logits = forward(model, input_ids)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                                           ignore_index=-100)
    config = model.config
    router_logits = recorder.logits()
    rows = B // k
    counted = (labels != -100).sum()
    auxes = []
    weighted = 0.0
    for j in range(k):
        chunk = tuple(l[j * rows * T:(j + 1) * rows * T] for l in router_logits)
        aux = load_balancing_loss_func(chunk, config.num_experts, config.num_experts_per_tok)
        auxes.append(aux)
        weighted = weighted + (labels[j * rows:(j + 1) * rows] != -100).sum() / counted * aux
    return logits, ce + config.router_aux_loss_coef * weighted, torch.stack(auxes).detach()


def update_bias(model, recorder):
    """DeepSeek's aux-loss-free update: bias += rate * sign(mean load - load), load over the batch."""
    rate = getattr(model.config, "router_bias_update_rate", 0.0)
    with torch.no_grad():
        for i, router in routers(model):
            if not hasattr(router, "e_score_correction_bias"):
                continue
            ids = recorder.out[i][2]
            load = torch.bincount(ids.reshape(-1), minlength=model.config.num_experts).double()
            router.e_score_correction_bias.add_((rate * torch.sign(load.mean() - load)).float())


def make(args):
    torch.manual_seed(0)
    config = qwen3_config(args.variant)
    model = build(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # a norm loaded wrong shows
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # peaked routing: no top-k choice is a near tie rounding could flip
            elif "experts" in name or "shared_experts" in name:
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    os.makedirs(os.path.join(args.out, "hf"), exist_ok=True)
    if args.variant == "qwen3":
        model.save_pretrained(os.path.join(args.out, "hf"))
    else:
        state = per_expert(dict(model.state_dict()))
        save_file(state, os.path.join(args.out, "hf", "model.safetensors"), metadata={"format": "pt"})
        cfg = config.to_dict()
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
        with open(os.path.join(args.out, "hf", "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    saved = load_file(os.path.join(args.out, "hf", "model.safetensors"))
    expected = per_expert(dict(model.state_dict()))
    assert set(saved) == set(expected), sorted(set(saved) ^ set(expected))[:8]
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in saved), "the saved files are not per expert"

    input_ids, labels = batch(config.vocab_size)
    out = {"input_ids": input_ids, "labels": labels}
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = Recorder(model)
    model.train()
    with torch.no_grad():
        out["logits"] = forward(model, input_ids)
    gaps = []
    for i, (logits, weights, ids) in sorted(recorder.out.items()):
        order = ids.argsort(-1)
        out[f"routing.ids.{i}"] = ids.gather(-1, order)
        out[f"routing.weights.{i}"] = weights.detach().gather(-1, order)
        # The margin of each token's choice: k-th best minus (k+1)-th best choice score.
        router = dict(routers(model))[i]
        if hasattr(router, "e_score_correction_bias"):
            score = logits.sigmoid() + router.e_score_correction_bias
        else:
            score = logits.softmax(-1)
        top = score.topk(config.num_experts_per_tok + 1, -1).values
        gaps.append((top[:, -2] - top[:, -1]).min().item())
    print(f"smallest margin of a top-{config.num_experts_per_tok} choice: {min(gaps):.3g}")
    if args.variant == "qwen3":
        # transformers' own aux_loss (output_router_logits=True) against load_balancing_loss_func
        # on the recorded logits of the whole batch.
        with torch.no_grad():
            hf = model(input_ids=input_ids, output_router_logits=True)
            mine = load_balancing_loss_func(recorder.logits(), config.num_experts, config.num_experts_per_tok)
        print(f"transformers' aux_loss {hf.aux_loss.item():.7f}, load_balancing_loss_func {mine.item():.7f}")
        assert abs(hf.aux_loss.item() - mine.item()) < 1e-6

    for k in SPLITS:
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        _, loss, auxes = loss_of(model, recorder, input_ids, labels, k)
        loss.backward()
        out[f"aux.k{k}"] = auxes
        out[f"loss.k{k}"] = loss.detach().reshape(1)
        grads = per_expert({name: p.grad for name, p in model.named_parameters()})
        for name, g in grads.items():
            out[f"grad.k{k}.{name}"] = g
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
        for step in range(STEPS):
            if step:
                opt.zero_grad()
                _, l, _ = loss_of(model, recorder, input_ids, labels, k)
                l.backward()
            opt.step()
            update_bias(model, recorder)
        with torch.no_grad():
            out[f"trained_logits.k{k}"] = forward(model, input_ids)
        for name, t in per_expert(dict(model.state_dict())).items():
            out[f"trained.k{k}.{name}"] = t
        print(f"split {k}: loss {loss.item():.6f}, aux per chunk {[round(a, 6) for a in auxes.tolist()]}")
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "reference.safetensors"))
    print(f"made {args.variant}")


def check(args):
    ref = load_file(os.path.join(args.out, "reference.safetensors"))
    with open(os.path.join(args.exported, "config.json")) as f:
        exported_config = json.load(f)
    k = args.k
    if exported_config.get("scoring_func", "softmax") == "softmax":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.exported, dtype=torch.float32)
        state = per_expert(dict(model.state_dict()))
    else:
        from transformers import Qwen3MoeConfig
        model = build(Qwen3MoeConfig.from_pretrained(args.exported)).float()
        files = {}
        index = os.path.join(args.exported, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                for name in sorted(set(json.load(f)["weight_map"].values())):
                    files.update(load_file(os.path.join(args.exported, name)))
        else:
            files = load_file(os.path.join(args.exported, "model.safetensors"))
        model.load_state_dict(fused(files, model), strict=True)
        state = per_expert(dict(model.state_dict()))
    model.eval()
    bad = 0
    worst = 0.0
    for name, t in state.items():
        want = ref[f"trained.k{k}.{name}"]
        err = (t - want).abs().max().item()
        worst = max(worst, err)
        if err > 5e-5:
            print(f"{name}: max |exported - transformers-trained| = {err:.3g}")
            bad += 1
    missing = [n for n in ref if n.startswith(f"trained.k{k}.") and n[len(f"trained.k{k}."):] not in state]
    if missing:
        print(f"not in the export: {missing[:5]}")
        bad += 1
    with torch.no_grad():
        logits = forward(model, ref["input_ids"])
    err = (logits - ref[f"trained_logits.k{k}"]).abs().max().item()
    print(f"exported model: {len(state)} tensors within {worst:.3g} of transformers' after {STEPS} AdamW steps; "
          f"logits within {err:.3g}")
    if err > 1e-4:
        bad += 1
    if args.cpp_logits:
        cpp = load_file(args.cpp_logits)["logits"]
        err = (logits - cpp).abs().max().item()
        print(f"exported model's logits in transformers vs the C++ model's: max difference {err:.3g}")
        if err > 1e-5:
            bad += 1
    sys.exit(1 if bad else 0)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    m.add_argument("--variant", choices=["qwen3", "deepseek"], default="qwen3")
    c = sub.add_parser("check")
    c.add_argument("out")
    c.add_argument("exported")
    c.add_argument("k", type=int)
    c.add_argument("cpp_logits", nargs="?")
    b = sub.add_parser("batch", help="several commands in one process (tests/models/reference_batch.py)")
    b.add_argument("list")

    def dispatch(args):
        os.makedirs(args.out, exist_ok=True)
        make(args) if args.cmd == "make" else check(args)

    args = p.parse_args()
    if args.cmd == "batch":
        import reference_batch
        reference_batch.run(args.list, lambda argv: dispatch(p.parse_args(argv)))
    else:
        dispatch(args)


if __name__ == "__main__":
    main()
