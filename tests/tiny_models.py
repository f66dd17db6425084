"""Small torch-only models for mechanism tests (no transformers)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class TinyLM(nn.Module):
    """embedding -> blocks -> head: the structure `forward_units` expects of a causal LM."""

    def __init__(self, vocab: int = 128, d: int = 64, hidden: int = 128, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, hidden) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss(self, ids):
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def param_groups(model, weight_decay=0.1):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
