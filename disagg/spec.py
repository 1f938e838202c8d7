"""The DLRM's architecture (``DLRMSpec``), its named presets and their shipped weights.

Pure Python, so configs and request validation use it without loading torch; ``disagg.model`` builds the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

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
    return DLRMSpec(
        num_dense=13, table_sizes=sizes, embedding_dim=16, bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1)
    )


#: Named architectures. ``criteo-kaggle`` holds 33.76M embedding rows (2.2 GB in FP32); ``small`` and ``tiny``
#: have the same shape with every table capped at 100,000 rows (0.84M rows, 51 MiB) and 1000 rows, for
#: profiling, tests and demos.
PRESETS: Mapping[str, DLRMSpec] = MappingProxyType(
    {
        "criteo-kaggle": _criteo_shaped(),
        "small": _criteo_shaped(max_rows_per_table=100_000),
        "tiny": _criteo_shaped(max_rows_per_table=1000),
    }
)


#: Trained weights shipped with a preset (its ``state_dict`` as safetensors): ``tiny`` was trained on synthetic
#: click logs with a known ground truth (``training.click_logs``; how: ``python -m training.tiny_dlrm``).
PRESET_WEIGHTS: Mapping[str, Path] = MappingProxyType(
    {"tiny": Path(__file__).resolve().parent / "weights" / "tiny" / "model.safetensors"}
)


def preset_weights(name: str) -> Path | None:
    """The trained weights shipped for preset ``name``, or None when it has none (seeded initialisation only)."""
    preset_spec(name)
    return PRESET_WEIGHTS.get(name)


def preset_spec(name: str) -> DLRMSpec:
    """The architecture of preset ``name``; ValueError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown DLRM preset {name!r}; known presets: {known}") from None
