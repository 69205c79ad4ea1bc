"""Fine-tune a small Llama-architecture model (random init from a config, no download) with
attn_implementation="attn_dispatch": a few steps on the same arithmetic-progression task as train_gpt_cpu.py,
on padded batches, through Hugging Face transformers' AttentionInterface.

Run:  python examples/finetune_llama_hf.py --steps 30      (needs `pip install attn-dispatch[hf]`)
"""
from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attn_dispatch.integrations.transformers import register

VOCAB = 64


def batch(gen: torch.Generator, size: int = 16, length: int = 24) -> dict:
    """Progressions modulo VOCAB with a random start and step; the last few rows are left-padded."""
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    step = torch.randint(1, 4, (size, 1), generator=gen)
    ids = (start + step * torch.arange(length)) % VOCAB
    mask = torch.ones_like(ids)
    mask[-4:, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def train(steps: int = 30, seed: int = 0, log=print) -> list[float]:
    register()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("attn_dispatch")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        loss = model(**batch(gen)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"step {step:3d} loss {loss.item():.3f}")
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    train(ap.parse_args().steps)
