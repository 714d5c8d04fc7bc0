"""torch.optim.Muon (plus torch.optim.AdamW for the rest) on the unsharded model: the reference of
muon_torch_test.

usage: muon_torch_reference.py OUT_DIR

The model (muon_torch_main.cc builds the same one, with the same FQNs): l0 = Linear(10, 24) (a tall
weight, orthogonalized transposed), l1 = Linear(24, 7) (wide), l2 = Linear(7, 7, bias=False), head =
Linear(7, 3), tanh between them. Muon steps l0/l1/l2's weights (head.weight is excluded, as the
usual recipe excludes the output layer), AdamW the biases and the head. Five steps of
mse_loss(model(x), y) on a batch of 12 rows (every C++ rank trains on the whole batch: see
muon_torch_main.cc).

Writes OUT_DIR/inputs.safetensors: the initial parameters ("init.<fqn>") and the batches ("x<step>",
"y<step>"); OUT_DIR/results.safetensors: per configuration "<config>.param.<fqn>" after the last
step, "<config>.momentum_buffer.<fqn>" from torch's optimizer state and "<config>.loss" (the five
losses).
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

STEPS = 5
BATCH = 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = torch.nn.Linear(10, 24)
        self.l1 = torch.nn.Linear(24, 7)
        self.l2 = torch.nn.Linear(7, 7, bias=False)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        x = torch.tanh(self.l0(x))
        x = torch.tanh(self.l1(x))
        x = torch.tanh(self.l2(x))
        return self.head(x)


def muon_groups(model, config):
    """Muon's param groups for `config` (muon_torch_main.cc builds the same)."""
    if config == "default":
        return [{"params": [model.l0.weight, model.l1.weight, model.l2.weight]}], dict(lr=0.02)
    # Two groups, every option away from its default.
    return [
        {"params": [model.l0.weight, model.l1.weight]},
        {"params": [model.l2.weight], "lr": 0.01, "adjust_lr_fn": "spectral_unclamped", "nesterov": True},
    ], dict(lr=0.05, weight_decay=0.01, momentum=0.9, nesterov=False, ns_coefficients=(1.875, -1.25, 0.375),
            eps=1e-5, ns_steps=6, adjust_lr_fn="match_rms_adamw")


def main(out_dir):
    torch.manual_seed(0)
    init = Net().state_dict()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]
    inputs = {f"init.{k}": v.contiguous() for k, v in init.items()}
    for s, (x, y) in enumerate(batches):
        inputs[f"x{s}"] = x
        inputs[f"y{s}"] = y
    save_file(inputs, f"{out_dir}/inputs.safetensors")

    results = {}
    for config in ("default", "variant"):
        model = Net()
        model.load_state_dict(init)
        groups, defaults = muon_groups(model, config)
        muon = torch.optim.Muon(groups, **defaults)
        other = [model.l0.bias, model.l1.bias, model.head.weight, model.head.bias]
        adamw = torch.optim.AdamW(other, lr=1e-3, weight_decay=0.01)
        losses = []
        for x, y in batches:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
        names = {id(p): n for n, p in model.named_parameters()}
        for name, p in model.named_parameters():
            results[f"{config}.param.{name}"] = p.detach().clone()
        for p, state in muon.state.items():
            results[f"{config}.momentum_buffer.{names[id(p)]}"] = state["momentum_buffer"].clone()
        results[f"{config}.loss"] = torch.tensor(losses, dtype=torch.float64)
        print(f"torch.optim.Muon ({config}): losses " + " ".join(f"{v:.6f}" for v in losses), flush=True)
    save_file(results, f"{out_dir}/results.safetensors")


if __name__ == "__main__":
    main(sys.argv[1])
