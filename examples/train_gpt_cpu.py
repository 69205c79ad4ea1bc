"""A small GPT trained on the CPU with attn_dispatch.DotProductAttention (the unfused engine there).

The data are arithmetic progressions modulo the vocabulary with a random start and a random step in
{1, 2, 3}: predicting the next token needs the step, which only attention to earlier tokens reveals.
Run:  python examples/train_gpt_cpu.py --steps 40
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from attn_dispatch import DotProductAttention


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.attn = DotProductAttention(heads, self.head_dim, num_gqa_groups=kv_heads, attention_dropout=dropout,
                                        qkv_format="bshd", attn_mask_type="causal")
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        x = x + self.proj(self.attn(q, k, v))  # [b, s, heads * head_dim]
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 max_len: int = 64, dropout: float = 0.0):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads, dropout) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(generator: torch.Generator, size: int, length: int, vocab: int) -> torch.Tensor:
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    step = torch.randint(1, 4, (size, 1), generator=generator)
    return (start + step * torch.arange(length + 1)) % vocab


def train(steps: int = 40, seed: int = 0, batch_size: int = 16, length: int = 32, vocab: int = 64,
          dropout: float = 0.1, log=print) -> list[float]:
    torch.manual_seed(seed)
    data_rng = torch.Generator().manual_seed(seed + 1)
    model = TinyGPT(vocab=vocab, dropout=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens = batch(data_rng, batch_size, length, vocab)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:3d}  loss {loss.item():.3f}")
    log(f"engine: {model.blocks[0].attn.last_decision.chosen}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    t0 = time.perf_counter()
    losses = train(args.steps, args.seed, dropout=args.dropout)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
