"""DeepFM (Guo et al. 2017): a first-order weight per id (a width-1 ``nn.EmbeddingBag``), the factorization
machine's second-order term over the field vectors, and a deep MLP over the field vectors and dense features.

Factory ``disagg.examples.deepfm:build``; signature:

- input ``dense`` FP32 [-1, 3];
- input ``fields`` INT64 [-1, 4]: one id per field (tables of 1000, 400, 200 and 50 rows);
- output ``probability`` FP32 [-1, 1].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from disagg.model import mlp

FIELD_ROWS = (1000, 400, 200, 50)
NUM_DENSE = 3
EMBEDDING_DIM = 8


class DeepFM(nn.Module):
    """``sigmoid(linear(dense) + sum of first-order weights + FM(field vectors) + deep([dense, field vectors]))``."""

    def __init__(self, field_rows: Sequence[int] = FIELD_ROWS, num_dense: int = NUM_DENSE,
                 embedding_dim: int = EMBEDDING_DIM, hidden: Sequence[int] = (32, 16)) -> None:
        super().__init__()
        self.vectors = nn.ModuleList(nn.EmbeddingBag(rows, embedding_dim, mode="sum") for rows in field_rows)
        self.first_order = nn.ModuleList(nn.EmbeddingBag(rows, 1, mode="sum") for rows in field_rows)
        for bag in [*self.vectors, *self.first_order]:
            nn.init.normal_(bag.weight, std=0.1)
        self.linear = nn.Linear(num_dense, 1)
        self.deep = mlp(num_dense + len(field_rows) * embedding_dim, (*hidden, 1), relu_last=False)

    def forward(self, dense: torch.Tensor, fields: torch.Tensor) -> torch.Tensor:
        ids = fields.unsqueeze(2)  # [B, fields, 1]: a bag of one id per field
        vectors = torch.stack([bag(ids[:, field]) for field, bag in enumerate(self.vectors)], dim=1)
        first_order = torch.cat([bag(ids[:, field]) for field, bag in enumerate(self.first_order)], dim=1)
        second_order = 0.5 * (vectors.sum(dim=1).pow(2) - vectors.pow(2).sum(dim=1)).sum(dim=1, keepdim=True)
        deep = self.deep(torch.cat([dense, vectors.flatten(1)], dim=1))
        return torch.sigmoid(self.linear(dense) + first_order.sum(dim=1, keepdim=True) + second_order + deep)


def build() -> DeepFM:
    """DeepFM over 3 dense features and 4 categorical fields, initialised from the torch seed."""
    return DeepFM()
