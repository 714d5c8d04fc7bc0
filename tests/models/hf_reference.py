"""Reference values from Hugging Face transformers for the C++ models (models/), on the CPU in float32.

  hf_reference.py make OUT --model llama [--tied] [--rope llama3]
      OUT/hf/        a tiny random model saved with save_pretrained (config.json, model.safetensors)
      OUT/reference.safetensors
          input_ids [B, T] int64, labels [B, T] int64 (some -100: label padding, unevenly per row),
          logits [B, T, V] of the initial model, loss (mean over counted labels, transformers' loss),
          grad.<fqn> of every parameter after loss.backward(), and after 3 AdamW steps on the same
          batch (lr 1e-2, weight decay 0.1): trained.<fqn> and trained_logits.
  hf_reference.py check OUT EXPORTED [CPP_LOGITS]
      loads EXPORTED (a folder the C++ side exported after its 3 steps) with
      AutoModelForCausalLM.from_pretrained, and checks its parameters and logits against the
      transformers-trained ones (and the C++ side's logits when given). Exit 1 on a mismatch.

  hf_reference.py batch LIST
      the commands of LIST (one per line, this script's arguments) in one process
      (tests/models/reference_batch.py).

Nothing is downloaded: the configs are built here.
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

B, T = 12, 16
LR, WD, STEPS = 1e-2, 0.1, 3


def build(model, tied, rope):
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if rope == "llama3":
            rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8}
        config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rms_norm_eps=1e-5, rope_parameters=rope_parameters, tie_word_embeddings=tied,
                             bos_token_id=1, eos_token_id=2)
        return LlamaForCausalLM(config)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                            router_aux_loss_coef=0.0)
    return Qwen3MoeForCausalLM(config)


def batch(vocab, T=T):
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.roll(input_ids, -1, 1).clone()
    # Label padding: row r ignores its last r % 5 positions (uneven over rows, hence over data ranks).
    for r in range(B):
        k = r % 5
        if k:
            labels[r, T - k:] = -100
    return input_ids, labels


def loss_of(model, input_ids, labels):
    logits = model(input_ids=input_ids).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                     labels.reshape(-1), ignore_index=-100)


def make(args):
    torch.manual_seed(0)
    model = build(args.model, args.tied, args.rope).float()
    # Random (not default) norm weights, so that a norm loaded wrong shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(os.path.join(args.out, "hf"))
    input_ids, labels = batch(model.config.vocab_size, args.time)
    out = {"input_ids": input_ids, "labels": labels}
    model.train()
    logits, loss = loss_of(model, input_ids, labels)
    loss.backward()
    out["logits"] = logits.detach()
    out["loss"] = loss.detach().reshape(1)
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        if step:
            opt.zero_grad()
            _, loss = loss_of(model, input_ids, labels)
            loss.backward()
        opt.step()
    with torch.no_grad():
        out["trained_logits"] = model(input_ids=input_ids).logits
    for name, p in model.named_parameters():
        out["trained." + name] = p.detach().clone()
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(args.out, "reference.safetensors"))
    print(f"made {args.model} (tied={args.tied}, rope={args.rope}): loss {loss.item():.6f}")


def check(args):
    from transformers import AutoModelForCausalLM
    ref = load_file(os.path.join(args.out, "reference.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(args.exported, dtype=torch.float32)
    model.eval()
    bad = 0
    worst = 0.0
    for name, p in model.named_parameters():
        want = ref["trained." + name]
        err = (p.detach() - want).abs().max().item()
        worst = max(worst, err)
        if err > 5e-5:  # AdamW carries the gradients' rounding: see llama_parity_main.cc
            print(f"parameter {name}: max |exported - transformers-trained| = {err:.3g}")
            bad += 1
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    err = (logits - ref["trained_logits"]).abs().max().item()
    print(f"exported model: parameters within {worst:.3g} of transformers' after {STEPS} AdamW steps; "
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
    m.add_argument("--model", choices=["llama", "moe"], default="llama")
    m.add_argument("--tied", action="store_true")
    m.add_argument("--rope", choices=["default", "llama3"], default="default")
    m.add_argument("--time", type=int, default=T, help="sequence length of the batch (context parallel: 24 splits "
                   "over cp 2, 3 and 4)")
    c = sub.add_parser("check")
    c.add_argument("out")
    c.add_argument("exported")
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
