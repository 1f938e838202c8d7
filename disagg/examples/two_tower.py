"""A two-tower retrieval model: a user tower over the user's embedding and the mean of their history's item
embeddings, an item tower over the candidate item's embedding; the score is the dot product of the two towers'
unit vectors.

Factory ``disagg.examples.two_tower:build``; signature:

- input ``user_id`` INT64 [-1]: the user (a table of 1000 rows);
- input ``history`` INT64 [-1, -1]: items the user interacted with (a table of 2000 rows), averaged; 0 pads
  (``pad_value: 0``: the bag's ``padding_idx``, left out of the mean), so item ids are 1 to 1999;
- input ``item_id`` INT64 [-1]: the candidate item (a table of 2000 rows);
- output ``score`` FP32 [-1, 1]: cosine similarity of the user and the candidate;
- output ``user_embedding`` FP32 [-1, 16]: the user tower's unit vector (for a nearest-neighbour index of items).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

USERS, ITEMS = 1000, 2000
EMBEDDING_DIM = 16
#: The history id that pads a shorter history.
PADDING_ITEM = 0


class TwoTower(nn.Module):
    """``forward(user_id, history, item_id) -> (score [B, 1], user_embedding [B, dim])``."""

    def __init__(self, users: int = USERS, items: int = ITEMS, dim: int = EMBEDDING_DIM, hidden: int = 32) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim)
        self.history = nn.EmbeddingBag(items, dim, mode="mean", padding_idx=PADDING_ITEM)
        self.items = nn.Embedding(items, dim)
        self.user_tower = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.item_tower = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, user_id: torch.Tensor, history: torch.Tensor, item_id: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        user = self.user_tower(torch.cat([self.users(user_id), self.history(history)], dim=1))
        user = F.normalize(user, dim=1)
        item = F.normalize(self.item_tower(self.items(item_id)), dim=1)
        return (user * item).sum(dim=1, keepdim=True), user


def build() -> TwoTower:
    """The two-tower model over 1000 users and 2000 items, initialised from the torch seed."""
    return TwoTower()
