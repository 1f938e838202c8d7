"""DCN-v2 (Wang et al. 2021), stacked: cross layers ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l`` over the dense features
and the pooled categorical features, then a deep MLP to a click probability.

Factory ``disagg.examples.dcn_v2:build``; signature:

- input ``dense`` FP32 [-1, 4];
- input ``categorical`` INT64 [-1, 3, -1]: a bag of ids per feature (tables of 500, 300 and 100 rows), summed,
  -1 an empty slot (``pad_value: -1``);
- output ``probability`` FP32 [-1, 1].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from disagg.model import mlp

TABLE_ROWS = (500, 300, 100)
NUM_DENSE = 4
EMBEDDING_DIM = 8


class CrossLayer(nn.Module):
    """One full-rank cross layer: ``x0 * (W x + b) + x``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.linear(x) + x


class DCNv2(nn.Module):
    """Sum-pooled bags (-1 slots weigh 0), cross layers over ``[dense, bags...]``, deep MLP, sigmoid."""

    def __init__(self, table_rows: Sequence[int] = TABLE_ROWS, num_dense: int = NUM_DENSE,
                 embedding_dim: int = EMBEDDING_DIM, cross_layers: int = 2, deep: Sequence[int] = (32, 16)) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, embedding_dim, mode="sum") for rows in table_rows)
        for bag in self.bags:
            nn.init.normal_(bag.weight, std=0.1)
        width = num_dense + len(table_rows) * embedding_dim
        self.cross = nn.ModuleList(CrossLayer(width) for _ in range(cross_layers))
        self.deep = mlp(width, (*deep, 1), relu_last=False)

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        ids = categorical.clamp(min=0)
        present = (categorical >= 0).to(torch.float32)
        pooled = [bag(ids[:, feature], per_sample_weights=present[:, feature])
                  for feature, bag in enumerate(self.bags)]
        x0 = torch.cat([dense, *pooled], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return torch.sigmoid(self.deep(x))


def build() -> DCNv2:
    """DCN-v2 over 4 dense and 3 categorical features, initialised from the torch seed."""
    return DCNv2()
