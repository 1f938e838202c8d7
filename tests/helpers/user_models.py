"""User models (``model.factory``) in the disagg tests: the shipped examples' Serve configs, factories written to
files, requests drawn within a model's id ranges, which tensors a weights file is read for, and a model served
disaggregated in this process (shards and dense part built alone, rows fetched from the shards, pooled)."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import disagg.model_source
from disagg.config import DLRMAppConfig
from disagg.id_ranges import IdRange, torch_dtype
from disagg.lookup import LocalRows, RemoteEmbeddings
from disagg.model_check import output_tensors
from disagg.model_source import ModelSource
from disagg.partition import build_dense_part, embedding_lookups
from disagg.signature import INTEGER_DATATYPES, VARIABLE, ModelSignature
from disagg.tables import TableLayout, TableShard, build_embedding_shard
from tests.helpers import REPO

EXAMPLE_CONFIGS = REPO / "deploy" / "examples"
EXAMPLES = ("dlrm", "dcn_v2", "deepfm", "two_tower")


def example_serve_config(name: str) -> dict[str, Any]:
    """The Serve config ``deploy/examples/<name>.yaml``."""
    return yaml.safe_load((EXAMPLE_CONFIGS / f"{name}.yaml").read_text())


def example_config(name: str, **model: Any) -> DLRMAppConfig:
    """The app args of example ``name``'s Serve config, with ``model`` fields replaced."""
    (app,) = example_serve_config(name)["applications"]
    args = app["args"]
    return DLRMAppConfig.model_validate({**args, "model": {**args["model"], **model}})


def write_factory(directory: Path, source: str, function: str = "build") -> str:
    """Writes ``source`` (dedented) to ``directory/model.py``; returns the factory ``/abs/path/model.py:function``."""
    path = directory / "model.py"
    path.write_text(textwrap.dedent(source))
    return f"{path}:{function}"


def user_config(factory: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]] | None = None,
                **model: Any) -> DLRMAppConfig:
    """A disaggregated app serving ``factory`` with this signature (and other ``model`` fields)."""
    signature = {"inputs": inputs} if outputs is None else {"inputs": inputs, "outputs": outputs}
    return DLRMAppConfig.model_validate({"model": {"factory": factory, **signature, **model}})


def draw_inputs(signature: ModelSignature, ranges: Mapping[str, IdRange], batch: int, seed: int,
                length: int = 4) -> dict[str, torch.Tensor]:
    """A request's tensors by ``forward`` argument: ``length`` for every variable dimension, integer inputs drawn in
    ``[0, high)`` of their range (a quarter of them the input's ``pad_value`` where it has one), floats normal."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for tensor in signature.inputs:
        shape = (batch, *(length if size == VARIABLE else size for size in tensor.shape[1:]))
        if tensor.datatype in INTEGER_DATATYPES:
            high = torch.from_numpy(ranges[tensor.name].high)
            value = (torch.rand(shape, generator=generator, dtype=torch.float64) * high).to(torch.int64)
            if tensor.pad_value is not None:
                value[torch.rand(shape, generator=generator) < 0.25] = int(tensor.pad_value)
        else:
            value = torch.randn(shape, generator=generator)
        inputs[tensor.forward_argument] = value.to(torch_dtype(tensor.datatype))
    return inputs


def build_shards(source: ModelSource, layout: TableLayout) -> list[TableShard]:
    """Every shard of ``layout``, each built alone from ``source``."""
    return [build_embedding_shard(source, index, layout) for index in range(layout.num_shards)]


def serve_disaggregated(source: ModelSource, shards: list[TableShard], inputs: Mapping[str, torch.Tensor]
                        ) -> list[torch.Tensor]:
    """The outputs the disaggregated app computes for ``inputs``: the dense part built alone, the rows of every
    batch's unique ids fetched from ``shards`` (``LocalRows``, what the gRPC client returns) and pooled on the dense
    side (``RemoteEmbeddings``)."""
    partition = build_dense_part(source)
    lookups = embedding_lookups(partition)
    layout_plan = [shard.slices for shard in shards]
    embeddings = RemoteEmbeddings(lookups, layout_plan, LocalRows(shards))
    cut = asyncio.run(embeddings({name: inputs[name] for name in lookups.inputs}, timeout_s=10.0))
    with torch.no_grad():
        returned = partition.dense_part(**{name: inputs[name] for name in partition.dense_inputs}, **cut)
    return output_tensors(returned, source.signature)


def serve_whole(source: ModelSource, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of the whole model ``source.build()``."""
    with torch.no_grad():
        return output_tensors(source.build()(**inputs), source.signature)


class _CountedReads:
    """A safetensors handle that records the key of every tensor read."""

    def __init__(self, handle: Any, read: list[str]) -> None:
        self._handle, self._read = handle, read

    def __enter__(self) -> _CountedReads:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._handle.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        self._read.append(key)
        return self._handle.get_tensor(key)


@contextmanager
def weights_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Within it, the keys ``disagg.model_source.load_parameters`` reads from weights files, in order."""
    read: list[str] = []
    opened = disagg.model_source.safe_open
    with monkeypatch.context() as patch:
        patch.setattr(disagg.model_source, "safe_open", lambda *args, **kwargs: _CountedReads(opened(*args, **kwargs),
                                                                                              read))
        yield read
