"""Checks a served model before any replica starts (``build_app``, ``autoconfig check``) and reports what the API
needs of it: its tables and the table each position of an id input indexes (``disagg.id_ranges``).

Every problem is one ``ModelError`` naming the config key and, for the graph, the node and source line at fault.
"""

from __future__ import annotations

import copy
import inspect
import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import fx, nn

from disagg.config import DLRMAppConfig
from disagg.id_ranges import PROBE_BATCH, PROBE_VARIABLE, IdRange, id_ranges, probe_shape, torch_dtype
from disagg.model import check_weights_header
from disagg.model_source import ModelError, ModelSource, model_source
from disagg.partition import Partition, embedding_lookups, partition_embeddings
from disagg.signature import VARIABLE, ModelSignature
from disagg.tables import embedding_tables


@dataclass(frozen=True)
class ModelReport:
    """What ``check_model`` found: the tables (``{name: (rows, dim)}``), each id input's range, notes for the user."""

    label: str
    tables: Mapping[str, tuple[int, int]]
    id_ranges: Mapping[str, IdRange]
    notes: tuple[str, ...] = field(default=())


def check_model(config: DLRMAppConfig) -> ModelReport:
    """Builds ``config``'s model structure (``ModelSource.skeleton``) and checks everything a replica would trip
    over: the factory, the weights file's keys and shapes, ``embedding.table_storage`` against the tables, the graph
    against torch.fx and the partitioner, the signature against ``forward``. ModelError otherwise; a graph that
    cannot be cut is only a note when served monolithically (its replicas run the model as it is)."""
    source = model_source(config.model)
    skeleton = _skeleton(source)
    weights = config.model.weights_path()
    if config.model.factory is not None and weights is not None:
        check_weights(skeleton, weights)
    tables = embedding_tables(skeleton)
    if unknown := sorted(set(config.embedding.table_storage) - set(tables)):
        raise ModelError("embedding.table_storage", f"unknown table {unknown[0]!r}; the model's tables: "
                         f"{', '.join(tables)}")
    try:
        partition = cut_model(skeleton)  # first: a value-dependent branch would fail the signature's forward pass
    except ModelError as exc:
        if config.serving == "disaggregated":
            raise
        # monolithic replicas run such a model as it is: no stacked tables, ids checked by its own lookups
        return ModelReport(source.label, tables, {}, (f"served as is, without stacked tables or id checks: {exc}",))
    check_signature(skeleton, source.signature)
    try:
        lookups = embedding_lookups(partition)
    except ValueError as exc:
        if config.serving == "disaggregated":
            raise ModelError("model", f"cannot serve disaggregated: {exc}") from None
        return ModelReport(source.label, tables, {}, (f"monolithic without stacked tables: {exc}",))
    return ModelReport(source.label, tables, id_ranges(lookups, source.signature),
                       tuple(sequence_cut_notes(partition, source.signature)))


def _skeleton(source: ModelSource) -> nn.Module:
    try:
        return source.skeleton()
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError("model.factory", f"{source.label}() raised {type(exc).__name__}: {exc}") from None


def check_weights(skeleton: nn.Module, path: str | Path) -> None:
    """The safetensors file ``path`` holds exactly ``skeleton``'s state dict (keys and shapes; a tensor tied under
    several keys under one of them at least), read from its header alone; ModelError naming the first key missing,
    unexpected or misshapen."""
    try:
        check_weights_header(path)
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelError("model.weights", f"{path}: {exc}") from None
    with handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118 (a safetensors handle)
    state = skeleton.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for key, tensor in state.items():
        tied.setdefault(id(tensor), []).append(key)
    if missing := sorted(keys[0] for keys in tied.values() if not shapes.keys() & set(keys)):
        raise ModelError("model.weights", f"{path} lacks {len(missing)} tensor(s) of the model, first {missing[0]!r}")
    if unexpected := sorted(shapes.keys() - state.keys()):
        raise ModelError("model.weights", f"{path} holds {len(unexpected)} tensor(s) the model has not, first "
                         f"{unexpected[0]!r} (weights of another model?)")
    for key, tensor in state.items():
        if key in shapes and shapes[key] != tuple(tensor.shape):
            raise ModelError("model.weights", f"{key!r} is {list(shapes[key])} in {path}, the model's is "
                             f"{list(tensor.shape)}")


def check_signature(skeleton: nn.Module, signature: ModelSignature) -> None:
    """``signature``'s inputs are ``forward``'s arguments (every required one fed), and ``forward`` on inputs of
    those shapes (meta tensors: no compute) returns its outputs with their ranks and fixed sizes."""
    parameters = inspect.signature(skeleton.forward).parameters
    named = [name for name, parameter in parameters.items()
             if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    open_ended = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    for index, tensor in enumerate(signature.inputs):
        if tensor.forward_argument not in named and not open_ended:
            raise ModelError(f"model.inputs[{index}]", f"{type(skeleton).__name__}.forward has no argument "
                             f"{tensor.forward_argument!r}; its arguments: {', '.join(named) or 'none'}")
    fed = {tensor.forward_argument for tensor in signature.inputs}
    for name, parameter in parameters.items():
        if name in named and parameter.default is inspect.Parameter.empty and name not in fed:
            raise ModelError("model.inputs", f"{type(skeleton).__name__}.forward needs argument {name!r}, which no "
                             "input feeds")
    meta = {tensor.forward_argument: torch.empty(probe_shape(tensor), dtype=torch_dtype(tensor.datatype),
                                                 device="meta") for tensor in signature.inputs}
    structure = _meta_copy(skeleton)
    try:
        with torch.no_grad():
            returned = structure(**meta)
    except Exception as exc:
        raise ModelError("model.inputs", f"{type(skeleton).__name__}.forward fails on inputs of the signature's "
                         f"shapes ({_shapes(meta)}): {type(exc).__name__}: {exc}") from None
    outputs = output_tensors(returned, signature)
    for index, (tensor, value) in enumerate(zip(signature.outputs, outputs, strict=True)):
        sizes = (PROBE_BATCH, *tensor.shape[1:])
        if value.dim() != len(sizes) or any(want not in (VARIABLE, got) for want, got in zip(sizes, value.shape,
                                                                                               strict=True)):
            raise ModelError(f"model.outputs[{index}]", f"{tensor.name!r} is declared {tensor.shape}, forward returns "
                             f"{list(value.shape)} for a batch of {PROBE_BATCH}")


def output_tensors(returned: Any, signature: ModelSignature) -> list[torch.Tensor]:
    """``forward``'s return value as one tensor per signature output, in order: a tensor (one output), a tuple or
    list, or a dict keyed by output name. ModelError when it does not fit."""
    names = [tensor.name for tensor in signature.outputs]
    if isinstance(returned, torch.Tensor):
        values = [returned]
    elif isinstance(returned, tuple | list) and all(isinstance(value, torch.Tensor) for value in returned):
        values = list(returned)
    elif isinstance(returned, Mapping):
        if set(returned) != set(names):
            raise ModelError("model.outputs", f"forward returns the keys {sorted(returned)}, the outputs are {names}")
        values = [returned[name] for name in names]
    else:
        raise ModelError("model.outputs", f"forward returns {type(returned).__name__}; expected a tensor, a tuple or "
                         "list of tensors, or a dict of them")
    if len(values) != len(names):
        raise ModelError("model.outputs", f"forward returns {len(values)} tensor(s), the signature has "
                         f"{len(names)} output(s): {names}")
    return values


def cut_model(skeleton: nn.Module) -> Partition:
    """``partition_embeddings(skeleton)``; a graph fx cannot trace (data-dependent control flow) is a ModelError
    naming the node and the source line, one the partitioner cannot cut a ModelError saying why."""
    try:
        fx.symbolic_trace(skeleton)
    except Exception as exc:  # torch.fx's TraceError (a ValueError) and what a forward raises on proxies
        raise ModelError("model", f"cannot trace {type(skeleton).__name__}.forward with torch.fx{_where(exc)}: "
                         f"{type(exc).__name__}: {exc}. The dense/embedding cut needs a graph that does not "
                         "depend on the values of the inputs: move value-dependent branches out of forward or "
                         "express them as tensor ops (torch.where, masks)") from None
    try:
        return partition_embeddings(skeleton)
    except ValueError as exc:
        raise ModelError("model", str(exc)) from None


def _where(exc: BaseException) -> str:
    """`` at node X, file:line (code)``: the proxy that was branched on and the innermost user frame."""
    node, frame = None, None
    for summary, (code_frame, _) in zip(traceback.extract_tb(exc.__traceback__),
                                        traceback.walk_tb(exc.__traceback__), strict=True):
        proxy = code_frame.f_locals.get("obj", code_frame.f_locals.get("self"))
        if isinstance(proxy, fx.Proxy):
            node = proxy.node.name
        if "/torch/" not in summary.filename:
            frame = summary
    where = f" at node {node!r}" if node else ""
    if frame is not None:
        where += f", {Path(frame.filename).name}:{frame.lineno} ({(frame.line or '').strip()})"
    return where


def _meta_copy(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the meta device, leaving ``module`` as it is."""
    structure = copy.deepcopy(module) if not _all_meta(module) else module
    return structure.to("meta")


def _all_meta(module: nn.Module) -> bool:
    return all(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])


def _shapes(tensors: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in tensors.items())


def sequence_cut_notes(partition: Partition, signature: ModelSignature) -> list[str]:
    """A note per cut tensor whose size grows with a variable input dimension (an unpooled sequence embedding),
    with its size per row: the dense side gathers it from deduplicated rows, so it costs memory there, not wire."""
    def cut_shapes(variable: int) -> dict[str, torch.Size]:
        meta = {t.forward_argument: torch.empty(probe_shape(t, variable=variable), dtype=torch_dtype(t.datatype),
                                                device="meta") for t in signature.inputs
                if t.forward_argument in partition.embedding_inputs}
        with torch.no_grad():
            cut = _meta_copy(partition.embedding_part)(**meta)
        return {name: value.shape for name, value in cut.items()}

    short, long = cut_shapes(PROBE_VARIABLE), cut_shapes(PROBE_VARIABLE + 2)
    notes = []
    for name, shape in short.items():
        if shape != long[name]:
            per_row = math.prod(shape[1:])
            sizes = ", ".join(map(str, shape[1:]))
            notes.append(f"embedding output {name!r} crosses the cut unpooled, [batch, {sizes}] "
                         f"at {PROBE_VARIABLE} ids per row ({per_row} values a row, growing with the sequence): the "
                         "dense side gathers it from the fetched unique rows, so it costs dense-side memory, not wire "
                         "bytes; pool it (nn.EmbeddingBag, or a sum/mean right after the lookup) if the model allows")
    return notes
