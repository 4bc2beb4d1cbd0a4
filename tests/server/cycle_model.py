"""A tiny checkpoint whose greedy output is known in advance: it spells a fixed text forever.

The weights make a bigram model over bytes: each byte of CYCLE_TEXT predicts the next one (and
the last predicts the first). The text has multi-byte characters, so tests can check that
streamed text never splits one, and exact stop-string behaviour.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_checkpoints import make_tiny_checkpoint

CYCLE_TEXT = "\nHé世🎉!"  # every byte distinct, so "next byte" is a function of the byte


def make_cycle_checkpoint(directory: str | Path) -> Path:
    import transformers

    directory = make_tiny_checkpoint(directory, "llama", seed=1, max_position_embeddings=1024)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    cycle = list(CYCLE_TEXT.encode())
    assert len(set(cycle)) == len(cycle)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        directions = torch.randn(embed.shape, generator=generator)
        directions /= directions.norm(dim=1, keepdim=True)
        embed.copy_(directions * 100.0)  # dwarfs what attention and MLP add to the residual
        lm_head = model.lm_head.weight  # [vocab, hidden]
        lm_head.zero_()
        for current, following in zip(cycle, cycle[1:] + cycle[:1], strict=True):
            lm_head[following] += directions[current] * 5.0
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory
