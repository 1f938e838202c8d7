"""A DLRM app serving a small user model written to a file (``model.factory``): two tables, an id input of both, an
unpooled history of items, and a variant that hashes its ids (no id range)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.user_models import write_factory

MODEL = """
    import torch
    from torch import nn


    class Recommender(nn.Module):
        # a user and an item looked up by id, the user's history of items attended to by the item (unpooled)

        def __init__(self):
            super().__init__()
            self.users, self.items = nn.Embedding(50, 4), nn.Embedding(1000, 4)
            self.head = nn.Linear(3 * 4 + 2, 1)

        def forward(self, dense, ids, history):
            user, item, past = self.users(ids[:, 0]), self.items(ids[:, 1]), self.items(history)
            weights = torch.softmax((past * item.unsqueeze(1)).sum(-1), dim=1)
            pooled = (weights.unsqueeze(-1) * past).sum(1)
            return torch.sigmoid(self.head(torch.cat([user, item, pooled, dense], dim=1)))


    class Hashed(nn.Module):
        def __init__(self):
            super().__init__()
            self.users = nn.Embedding(50, 4)

        def forward(self, dense, ids, history):
            rest = dense.sum(1, keepdim=True) + history.sum(1, keepdim=True)
            return self.users(ids % 50).sum((1, 2)).unsqueeze(1) + rest


    def build():
        return Recommender()


    def build_hashed():
        return Hashed()
"""
INPUTS = [
    {"name": "dense", "datatype": "FP32", "shape": [-1, 2]},
    {"name": "ids", "datatype": "INT64", "shape": [-1, 2]},
    {"name": "history", "datatype": "INT64", "shape": [-1, -1]},
]
OUTPUTS = [{"name": "click", "datatype": "FP32", "shape": [-1, 1]}]


def write_model(directory: Path, function: str = "build") -> str:
    """Writes the model file into ``directory``; the factory of ``build`` (or ``build_hashed``)."""
    return write_factory(directory, MODEL, function)


def app_args(factory: str, **model: Any) -> dict[str, Any]:
    """A DLRM app's args serving ``factory`` (model name ``ctr``)."""
    return {"model_name": "ctr", "model": {"factory": factory, "inputs": INPUTS, "outputs": OUTPUTS, **model}}
