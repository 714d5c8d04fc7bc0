"""The small model that the checkpoint interoperability tests build on both sides (Python here, the
same module tree in C++), and the deterministic values it starts from and trains on.

Parameters (fully qualified names, shapes; float32):
    emb.weight   [10, 13]   nn.Embedding(10, 13)
    w1.weight    [24, 13]   nn.Linear(13, 24)
    w1.bias      [24]
    w2.weight    [7, 24]    nn.Linear(24, 7)
    w2.bias      [7]
    norm.weight  [7]        nn.LayerNorm(7)   (eps 1e-5)
    norm.bias    [7]
forward(idx: int64 [B, T]) = norm(w2(relu(w1(emb(idx))))) -> float32 [B, T, 7]

Initial values (`init_parameters(model, seed)`) use no random generator, so any language reproduces
them exactly: the parameter with position p in PARAM_SHAPES (0-based, in the order above), element i
of its row-major flattening, gets

    ((i * 37 + p * 101 + seed * 13) % 64 - 32) / 128.0

every value a multiple of 1/128 in [-0.25, 0.2421875], exact in float32 (and bfloat16).
Training data (`batch(step, rank)`): idx[b, t] = (b * 3 + t * 5 + step * 7 + rank * 11) % 10 and
target[b, t, j] = ((b + 2 * t + 3 * j + step + rank) % 5 - 2) / 2.0, shapes [B, T] and [B, T, 7].
"""

import torch
import torch.nn as nn

VOCAB = 10
EMB = 13
HIDDEN = 24
OUT = 7

# Fully qualified name -> shape, in named_parameters() order.
PARAM_SHAPES = {
    "emb.weight": (VOCAB, EMB),
    "w1.weight": (HIDDEN, EMB),
    "w1.bias": (HIDDEN,),
    "w2.weight": (OUT, HIDDEN),
    "w2.bias": (OUT,),
    "norm.weight": (OUT,),
    "norm.bias": (OUT,),
}

# Submodules that the FSDP2 script shards on their own (then the root).
SHARDED_SUBMODULES = ("emb", "w1", "w2", "norm")


class InteropModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.w1 = nn.Linear(EMB, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, OUT)
        self.norm = nn.LayerNorm(OUT)

    def forward(self, idx):
        return self.norm(self.w2(torch.relu(self.w1(self.emb(idx)))))


def initial_value(p, shape, seed):
    """The initial value of the parameter at position p of PARAM_SHAPES (see the module doc)."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 37 + p * 101 + seed * 13) % 64 - 32).to(torch.float32) / 128.0
    return v.reshape(shape)


def init_parameters(model, seed):
    """Overwrites every parameter with its deterministic initial value (full, unsharded tensors)."""
    params = dict(model.named_parameters())
    if list(params) != list(PARAM_SHAPES):
        raise RuntimeError(f"unexpected parameter names {list(params)}")
    with torch.no_grad():
        for p, (name, shape) in enumerate(PARAM_SHAPES.items()):
            if tuple(params[name].shape) != shape:
                raise RuntimeError(f"{name}: shape {tuple(params[name].shape)}, expected {shape}")
            params[name].copy_(initial_value(p, shape, seed))
    return model


def build_model(seed=0):
    return init_parameters(InteropModel(), seed)


def batch(step, rank, batch_size=4, seq_len=6):
    """Deterministic (idx, target) of a training step on a rank (see the module doc)."""
    b = torch.arange(batch_size).view(-1, 1)
    t = torch.arange(seq_len).view(1, -1)
    idx = (b * 3 + t * 5 + step * 7 + rank * 11) % VOCAB
    j = torch.arange(OUT).view(1, 1, -1)
    target = ((b.unsqueeze(-1) + 2 * t.unsqueeze(-1) + 3 * j + step + rank) % 5 - 2).to(torch.float32) / 2.0
    return idx.to(torch.int64), target
