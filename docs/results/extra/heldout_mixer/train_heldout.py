#!/usr/bin/env python
"""Held-out DDP timing script: an MLP-Mixer language model with many DDP buckets.

The training loop, variants and RESULT_JSON are those of ../heldout_gru/train_heldout.py;
only the model differs: 16 Mixer blocks over a 32-token window (about 20 buckets at
bucket_cap_mb=0.4), where the GRU model had 6. Run once per rank as torchrun would.
"""
import os
import sys

import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "heldout_gru"))
import train_heldout as gru_script  # noqa: E402


class MixerBlock(nn.Module):
    def __init__(self, seq, width, token_hidden=64, channel_hidden=512):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.token_mlp = nn.Sequential(nn.Linear(seq, token_hidden), nn.GELU(), nn.Linear(token_hidden, seq))
        self.norm2 = nn.LayerNorm(width)
        self.channel_mlp = nn.Sequential(nn.Linear(width, channel_hidden), nn.GELU(),
                                         nn.Linear(channel_hidden, width))

    def forward(self, h):
        h = h + self.token_mlp(self.norm1(h).transpose(1, 2)).transpose(1, 2)
        return h + self.channel_mlp(self.norm2(h))


class MixerLanguageModel(nn.Module):
    """Same interface as the GRU model: tokens (B, 32) in, logits (B*32, vocab) out."""

    def __init__(self, vocab=8000, width=128, blocks=16, seq=32):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[MixerBlock(seq, width) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.emb(x)))).reshape(-1, self.vocab)


gru_script.GRULanguageModel = MixerLanguageModel

if __name__ == "__main__":
    gru_script.main()
