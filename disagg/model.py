"""DLRM (Naumov et al. 2019): bottom MLP, sum-pooled embedding bags, dot interaction, top MLP.

Weights are a pure function of ``(seed, module name)``, or read by module name from a safetensors file of trained
weights, so any part of the model (one embedding shard, the dense half) can be built on the meta device and
materialized alone with the values it has in the full model.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from disagg.spec import DLRMSpec, preset_spec


def build_preset(
    name: str, seed: int = 0, device: str | torch.device = "cpu", weights: str | os.PathLike | None = None
) -> DLRM:
    """Preset ``name`` with weights drawn deterministically from ``seed``, or read from the safetensors file
    ``weights`` (``disagg.spec.preset_weights(name)`` for the shipped ones); ``device="meta"`` allocates nothing."""
    return DLRM(preset_spec(name), seed=seed, device=device, weights=weights)


def mlp(in_features: int, widths: Sequence[int], *, relu_last: bool) -> nn.Sequential:
    """Linear layers of ``widths`` from ``in_features``, a ReLU after each but the last (after it too with
    ``relu_last``)."""
    layers: list[nn.Module] = []
    for index, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if relu_last or index < len(widths) - 1:
            layers.append(nn.ReLU())
        in_features = width
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Click probability from dense features and a bag of categorical ids per table.

    ``device="meta"`` builds the structure without memory; ``materialize_`` fills any part of it later. The
    interaction's pair indices are plain CPU buffers even then, so a traced part keeps working values.
    """

    def __init__(
        self,
        spec: DLRMSpec,
        *,
        seed: int = 0,
        device: str | torch.device = "cpu",
        weights: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.bottom_mlp = mlp(spec.num_dense, spec.bottom_mlp, relu_last=True)
            # ``_weight`` skips the module's own init: ``normal_`` on a meta tensor runs torch's Python reference,
            # whose imports (sympy, symbolic shapes) cost every process building the model tens of MiB
            # (``materialize_`` gives the values)
            self.embeddings = nn.ModuleList(
                nn.EmbeddingBag(rows, spec.embedding_dim, mode="sum", _weight=torch.empty(rows, spec.embedding_dim))
                for rows in spec.table_sizes
            )
            self.top_mlp = mlp(spec.interaction_width, spec.top_mlp, relu_last=False)
        rows, cols = torch.tril_indices(spec.num_tables + 1, spec.num_tables + 1, offset=-1, device="cpu")
        self.register_buffer("_pair_rows", rows, persistent=False)
        self.register_buffer("_pair_cols", cols, persistent=False)
        if torch.device(device).type != "meta":
            materialize_(self, seed=seed, weights=weights).to(device)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``dense`` [B, num_dense] float32, ``sparse`` [B, num_tables, H] int64 -> probabilities [B, 1].

        Each table's bag is the sum of the embeddings of its ids in the row; id -1 is padding (an all -1 bag
        pools to zeros), so one-hot input is H = 1.
        """
        ids = sparse.clamp(min=0)
        present = (sparse >= 0).to(torch.float32)
        pooled = [bag(ids[:, table], per_sample_weights=present[:, table]) for table, bag in enumerate(self.embeddings)]
        bottom = self.bottom_mlp(dense)
        vectors = torch.stack([bottom, *pooled], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        interaction = torch.cat([bottom, dots[:, self._pair_rows, self._pair_cols]], dim=1)
        return torch.sigmoid(self.top_mlp(interaction))


def _generator(seed: int, module_name: str) -> torch.Generator:
    """CPU generator seeded from ``seed`` and a module's qualified name by a stable 64-bit hash."""
    digest = hashlib.blake2b(f"{seed}/{module_name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


@torch.no_grad()
def materialize_(
    module: nn.Module,
    *,
    seed: int,
    weights: str | os.PathLike | None = None,
    only: Collection[str] | None = None,
) -> nn.Module:
    """Allocates ``module``'s meta parameters on the CPU and initialises every Linear and EmbeddingBag in place.

    ``module`` is a DLRM or a ``torch.fx.GraphModule`` cut from one: values depend only on ``seed`` and each
    layer's qualified name (``embeddings.3``, ``bottom_mlp.0``), so a part gets exactly the full model's values
    (the reference DLRM initialisation). With ``weights`` (a safetensors file holding a whole DLRM's
    ``state_dict``), every layer is read from it by the same names instead, and only the layers ``module`` holds
    are read. Parameters already on the CPU are overwritten without a second copy.

    ``only`` (qualified layer names) initialises or reads just those layers, with the same values, and leaves the
    rest as they are (on meta, say), so one table of a meta DLRM can be built alone; a name that is no Linear or
    EmbeddingBag of ``module`` is a ValueError.
    """
    layers = {name: layer for name, layer in module.named_modules() if isinstance(layer, nn.Linear | nn.EmbeddingBag)}
    if only is not None:
        unknown = sorted(set(only) - layers.keys())
        if unknown:
            raise ValueError(
                f"only: {unknown} name no Linear or EmbeddingBag layer of the module; its layers: {', '.join(layers)}"
            )
        layers = {name: layer for name, layer in layers.items() if name in only}
    with _open_weights(weights) as trained:
        for name, layer in layers.items():
            _allocate_on_cpu(layer)
            if trained is None:
                _initialise(layer, _generator(seed, name))
            else:
                _load(layer, name, trained)
    if only is None:
        left = [name for name, tensor in chain(module.named_parameters(), module.named_buffers()) if tensor.is_meta]
        if left:
            raise ValueError(f"materialize_ only initialises Linear and EmbeddingBag layers; still on meta: {left}")
    return module


def _allocate_on_cpu(layer: nn.Module) -> None:
    """Gives ``layer``'s own parameters off the CPU (meta) uninitialised CPU storage of their shape and dtype.

    Not ``Module.to_empty``: ``empty_like`` of a meta tensor runs torch's Python reference, whose imports (sympy,
    symbolic shapes) cost every process that builds the model tens of MiB."""
    for name, parameter in list(layer.named_parameters(recurse=False)):
        if parameter.device.type != "cpu":  # replaced in place, as ``to_empty`` does (no register_parameter hook)
            layer._parameters[name] = nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype),
                                                   requires_grad=parameter.requires_grad)


def _initialise(layer: nn.Linear | nn.EmbeddingBag, generator: torch.Generator) -> None:
    """The reference DLRM initialisation, drawn from ``generator``."""
    if isinstance(layer, nn.Linear):
        fan_out, fan_in = layer.weight.shape
        layer.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
        layer.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)
    else:
        bound = math.sqrt(1.0 / layer.num_embeddings)
        layer.weight.uniform_(-bound, bound, generator=generator)


#: Largest safetensors header of DLRM weights: a DLRM ``state_dict`` lists a few dozen tensors (``tiny``: 3.5 KB),
#: while a header of a million entries takes seconds and about 1 GB to parse.
MAX_WEIGHTS_HEADER_BYTES = 2**20


@dataclass(frozen=True)
class _TrainedWeights:
    """An open safetensors file of a DLRM ``state_dict``, its keys listed once (``keys()`` builds a new list)."""

    path: str | os.PathLike
    handle: Any
    keys: frozenset[str]

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.keys:
            raise ValueError(f"DLRM weights {self.path} hold no tensor {key!r}")
        try:
            return self.handle.get_tensor(key)
        except SafetensorError as exc:  # a dtype torch has no equivalent of
            raise ValueError(f"DLRM weights {self.path}: {key!r} cannot be read: {exc}") from None


@contextmanager
def _open_weights(path: str | os.PathLike | None) -> Iterator[_TrainedWeights | None]:
    """The safetensors file ``path``, reading tensors only when asked for, or None without a path. A file that is
    not valid safetensors (truncated, its header lying about offsets, shapes or dtypes) is a ValueError naming it."""
    if path is None:
        yield None
        return
    if not Path(path).is_file():
        raise FileNotFoundError(f"DLRM weights file not found: {path}")
    check_weights_header(path)
    try:
        handle = safe_open(os.fspath(path), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise ValueError(f"DLRM weights {path}: not a valid safetensors file: {exc}") from None
    with handle:
        yield _TrainedWeights(path, handle, frozenset(handle.keys()))


def check_weights_header(path: str | os.PathLike) -> None:
    """Refuse, unparsed, weights whose declared header is over ``MAX_WEIGHTS_HEADER_BYTES``."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")  # safetensors: a u64 header length, then the JSON header
    if length > MAX_WEIGHTS_HEADER_BYTES:
        raise ValueError(f"DLRM weights {path}: header is {length} bytes, over the {MAX_WEIGHTS_HEADER_BYTES}-byte "
                         "limit (a DLRM's lists a few dozen tensors)")


def _load(layer: nn.Module, name: str, trained: _TrainedWeights) -> None:
    """Copies the tensors ``{name}.weight`` (and ``.bias``) of ``trained`` into ``layer``, checking key and shape."""
    for parameter_name, parameter in layer.named_parameters(recurse=False):
        key = f"{name}.{parameter_name}"
        tensor = trained.tensor(key)
        if tensor.shape != parameter.shape or tensor.dtype != parameter.dtype:
            raise ValueError(
                f"DLRM weights {trained.path}: {key!r} is {tuple(tensor.shape)} {tensor.dtype}, the model's is "
                f"{tuple(parameter.shape)} {parameter.dtype} (weights of another architecture?)"
            )
        parameter.copy_(tensor)
