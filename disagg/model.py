"""DLRM (Naumov et al. 2019): bottom MLP, sum-pooled embedding bags, dot interaction, top MLP.

The forward pass is split into named stages (``bottom``, ``embed_bags``, ``interact``, ``top``) so
the graph partitioner can cut it after the embedding lookups and the two halves can run apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

#: Rows of the 26 categorical features of the Criteo Kaggle (Display Advertising Challenge) data set.
CRITEO_KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


@dataclass(frozen=True)
class DLRMSpec:
    """Architecture of a DLRM; MLP widths exclude the input width, which follows from the rest."""

    num_dense: int
    table_sizes: tuple[int, ...]
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("table_sizes", "bottom_mlp", "top_mlp"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.num_dense < 1:
            raise ValueError(f"num_dense must be >= 1, got {self.num_dense}")
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {self.embedding_dim}")
        for name in ("table_sizes", "bottom_mlp", "top_mlp"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {values}")
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp must end in embedding_dim ({self.embedding_dim}) so its output can interact "
                f"with the embeddings, got {self.bottom_mlp}"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp must end in 1 (one click logit), got {self.top_mlp}")

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def total_rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def interaction_width(self) -> int:
        """Top-MLP input: the bottom output plus one dot product per pair of the T+1 feature vectors."""
        vectors = self.num_tables + 1
        return self.embedding_dim + vectors * (vectors - 1) // 2


def _criteo_shaped(max_rows_per_table: int | None = None) -> DLRMSpec:
    sizes = CRITEO_KAGGLE_TABLE_SIZES
    if max_rows_per_table is not None:
        sizes = tuple(min(size, max_rows_per_table) for size in sizes)
    return DLRMSpec(num_dense=13, table_sizes=sizes, embedding_dim=16,
                    bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1))


#: Named architectures. ``criteo-kaggle`` holds 33.76M embedding rows (2.2 GB in FP32); ``tiny`` has the
#: same shape with every table capped at 1000 rows, for tests and demos.
PRESETS: Mapping[str, DLRMSpec] = MappingProxyType(
    {"criteo-kaggle": _criteo_shaped(), "tiny": _criteo_shaped(max_rows_per_table=1000)}
)


def preset_spec(name: str) -> DLRMSpec:
    """The architecture of preset ``name``; ValueError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown DLRM preset {name!r}; known presets: {known}") from None


def build_preset(name: str, seed: int = 0) -> DLRM:
    """Preset ``name`` with weights drawn deterministically from ``seed``, on the CPU."""
    return DLRM(preset_spec(name), seed=seed)


def _mlp(in_features: int, widths: Sequence[int], *, relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if relu_last or index < len(widths) - 1:
            layers.append(nn.ReLU())
        in_features = width
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Click probability from dense features and one categorical id per table.

    Weights are drawn on the CPU from a ``torch.Generator`` seeded with ``seed`` (the reference DLRM
    initialisation), so two models with the same spec and seed have bit-identical state dicts.
    """

    def __init__(self, spec: DLRMSpec, *, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        # Allocated uninitialised, then filled once by ``_init_weights`` (not twice: tables reach GBs).
        with torch.device("meta"):
            self.bottom_mlp = _mlp(spec.num_dense, spec.bottom_mlp, relu_last=True)
            self.embeddings = nn.ModuleList(
                nn.EmbeddingBag(rows, spec.embedding_dim, mode="sum") for rows in spec.table_sizes
            )
            self.top_mlp = _mlp(spec.interaction_width, spec.top_mlp, relu_last=False)
        self.to_empty(device="cpu")
        rows, cols = torch.tril_indices(spec.num_tables + 1, spec.num_tables + 1, offset=-1)
        self.register_buffer("_pair_rows", rows, persistent=False)
        self.register_buffer("_pair_cols", cols, persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                module.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
                module.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)
            elif isinstance(module, nn.EmbeddingBag):
                bound = math.sqrt(1.0 / module.num_embeddings)
                module.weight.uniform_(-bound, bound, generator=generator)

    def forward(self, dense: torch.Tensor, sparse_ids: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, num_dense] float32, ``sparse_ids`` [B, num_tables] int64 -> probabilities [B, 1]."""
        pooled = self.embed_one_hot(sparse_ids)
        return self.top(self.interact(self.bottom_mlp(dense), pooled))

    def embed_one_hot(self, sparse_ids: torch.Tensor) -> list[torch.Tensor]:
        """One id per row and table: each row is a bag of one, so offsets are ``0..B-1`` for every table."""
        offsets = torch.arange(sparse_ids.shape[0], device=sparse_ids.device)
        ids_per_table = sparse_ids.t().contiguous()
        return self.embed_bags([ids_per_table[t] for t in range(self.spec.num_tables)],
                               [offsets] * self.spec.num_tables)

    def embed_bags(
        self, indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Sum-pooled embeddings [B, dim] per table, from flat ids and bag start offsets per table."""
        return [bag(ids, starts) for bag, ids, starts in zip(self.embeddings, indices, offsets, strict=True)]

    def interact(self, bottom_out: torch.Tensor, pooled: Sequence[torch.Tensor]) -> torch.Tensor:
        """Bottom output concatenated with the pairwise dot products of all T+1 vectors (i > j only)."""
        vectors = torch.stack([bottom_out, *pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        return torch.cat([bottom_out, dots[:, self._pair_rows, self._pair_cols]], dim=1)

    def top(self, interaction: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.top_mlp(interaction))
