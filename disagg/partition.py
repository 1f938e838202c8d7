"""Cutting any ``nn.Module`` once, after its embedding lookups, into a CPU half and a dense half (torch.fx).

``partition_embeddings`` makes the cut; ``build_embedding_shard`` and ``build_dense_part`` build one part of a DLRM
alone: the model is built on the meta device, cut, and only the wanted part is materialized, with the full model's
values for the same seed (or the same trained weights file, of which only the part's tensors are read).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import fx, nn

from disagg.model import DLRM, materialize_
from disagg.spec import DLRMSpec

_EMBEDDING_MODULES = (nn.Embedding, nn.EmbeddingBag)
_EMBEDDING_FUNCTIONS = (F.embedding, F.embedding_bag)
_FUNCTION_OPS = ("call_function", "call_method")


@dataclass(frozen=True)
class EmbeddingShard:
    """One table-wise shard of an embedding part: ``module(**inputs)`` returns ``{name: tensor}`` for its outputs."""

    index: int
    module: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    parameter_bytes: int


@dataclass(frozen=True)
class Partition:
    """A model cut in two; the parts share their modules (and parameters) with the model they were cut from.

    ``embedding_part(**{name: input for name in embedding_inputs})`` returns ``{cut name: tensor}``;
    ``dense_part(**{name: input for name in dense_inputs}, **cut)`` returns what the model returns.
    """

    embedding_part: fx.GraphModule
    dense_part: fx.GraphModule
    embedding_inputs: tuple[str, ...]
    dense_inputs: tuple[str, ...]
    cut_names: tuple[str, ...]

    def __call__(self, **inputs: Any) -> Any:
        """The original model's output, computed by the embedding part and then the dense part."""
        missing = sorted(set(self.embedding_inputs + self.dense_inputs) - inputs.keys())
        if missing:
            raise TypeError(f"missing model inputs: {missing}")
        cut = self.embedding_part(**{name: inputs[name] for name in self.embedding_inputs})
        return self.dense_part(**{name: inputs[name] for name in self.dense_inputs}, **cut)

    def shards(self, num_shards: int) -> list[EmbeddingShard]:
        """The embedding part split table-wise into ``num_shards`` modules, each holding only its own parameters.

        Cut outputs that share a parameter form one group; groups go, largest parameter bytes first, to the
        least loaded shard (lowest index on ties). Within a shard, outputs keep the cut order.
        """
        groups = _parameter_groups(self.embedding_part)
        if not 1 <= num_shards <= len(groups):
            raise ValueError(
                f"num_shards must be between 1 and {len(groups)} (the independent embedding output groups), "
                f"got {num_shards}"
            )
        loads = [0] * num_shards
        members: list[list[str]] = [[] for _ in range(num_shards)]
        for names, size in sorted(groups, key=lambda group: -group[1]):
            target = loads.index(min(loads))
            loads[target] += size
            members[target].extend(names)
        outputs = _output_nodes(self.embedding_part)
        shards = []
        for index, chosen in enumerate(members):
            names = [name for name in self.cut_names if name in chosen]
            module = _extract(self.embedding_part, {name: outputs[name] for name in names}, {}, "EmbeddingShard")
            shards.append(EmbeddingShard(index, module, _placeholders(module), tuple(names), loads[index]))
        return shards


@dataclass(frozen=True)
class DenseStages:
    """``Partition.dense_part`` cut in two so that work not needing the embeddings overlaps their lookup.

    ``early(**{name: input for name in early_inputs})`` returns ``{name: tensor}`` for ``early_names`` (e.g. the
    DLRM bottom MLP); ``late(**inputs, **early, **cut)`` (its placeholders are ``late_inputs``) returns the model
    output. Composition equals ``dense_part``.
    """

    early: fx.GraphModule
    late: fx.GraphModule
    early_inputs: tuple[str, ...]
    early_names: tuple[str, ...]
    late_inputs: tuple[str, ...]


def dense_stages(partition: Partition) -> DenseStages:
    """Splits ``partition.dense_part`` at the nodes that depend on no cut tensor (computable before the lookup)."""
    dense = partition.dense_part
    nodes = list(dense.graph.nodes)
    cut = {node for node in nodes if node.op == "placeholder" and node.target in partition.cut_names}
    waits: set[fx.Node] = set()  # nodes downstream of a cut tensor, in graph (topological) order
    for node in nodes:
        if node in cut or any(source in waits for source in node.all_input_nodes):
            waits.add(node)
    early = [node for node in nodes if node.op not in ("placeholder", "get_attr", "output") and node not in waits
             and any(user in waits for user in node.users)]
    early_part = _extract(dense, {node.name: node for node in early}, {}, "DenseEarly")
    output = next(node for node in nodes if node.op == "output")
    late_part = _extract(dense, output.args[0], {node: node.name for node in early}, "DenseLate")
    return DenseStages(early_part, late_part, _placeholders(early_part), tuple(n.name for n in early),
                       _placeholders(late_part))


def partition_embeddings(model: nn.Module) -> Partition:
    """Traces ``model`` with ``torch.fx.symbolic_trace`` (meta parameters are fine) and cuts it.

    Node roles in the traced graph:

    - *input-only* nodes: placeholders, ``get_attr`` constants, and parameter-free functions/methods of those (e.g.
      ``ids.clamp(min=0)``, ``ids >= 0``). They are request preprocessing: each half recomputes the ones it needs,
      so they never cross the cut.
    - *embedding side*: every embedding operator (``nn.Embedding`` / ``nn.EmbeddingBag`` modules,
      ``F.embedding`` / ``F.embedding_bag``) and every other node it depends on, so this side never waits for a
      dense value. Then, in graph order, a parameter-free function/method joins it when (a) each input is an
      embedding-side value, a constant, or an input-only value over request inputs this side already reads, and
      (b) at least one of its embedding-side inputs has no other user outside this side. So the cut never gains a
      tensor and the CPU side never reads another request input: pooling after ``F.embedding`` joins it, a concat
      of the pooled vectors with a bottom-MLP output does not.
    - *dense side*: the rest. The cut is the embedding-side values it (or the model output) uses, in graph order,
      named after their nodes.
    """
    traced = fx.symbolic_trace(model)
    nodes = list(traced.graph.nodes)
    input_only = _input_only_nodes(traced, nodes)
    lookups = [node for node in nodes if _is_embedding_op(traced, node)]
    if not lookups:
        raise ValueError(
            f"{type(model).__name__} has no embedding operator (nn.Embedding, nn.EmbeddingBag, F.embedding or "
            "F.embedding_bag) to cut after"
        )
    embedding_side = _upstream(lookups, input_only) - input_only
    _absorb_forward(traced, nodes, embedding_side, input_only)
    cut = [node for node in nodes if node in embedding_side and any(u not in embedding_side for u in node.users)]
    cut_names = tuple(node.name for node in cut)
    embedding_part = _extract(traced, {node.name: node for node in cut}, {}, "EmbeddingPart")
    output = next(node for node in nodes if node.op == "output")
    dense_part = _extract(traced, output.args[0], {node: node.name for node in cut}, "DensePart")
    dense_inputs = tuple(name for name in _placeholders(dense_part) if name not in cut_names)
    return Partition(embedding_part, dense_part, _placeholders(embedding_part), dense_inputs, cut_names)


def build_embedding_shard(
    spec: DLRMSpec, seed: int, index: int, num_shards: int, weights: str | os.PathLike | None = None
) -> EmbeddingShard:
    """Shard ``index`` of ``num_shards`` of the DLRM's embedding part, holding only that shard's tables.

    The model is built on the meta device, cut, sharded and only the chosen shard is materialized, so a process
    serving one shard never allocates the other tables; values equal the full model's for the same seed, or for
    the same safetensors ``weights`` (only this shard's tables are read).
    """
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index must be in [0, {num_shards}), got {index}")
    shard = partition_embeddings(DLRM(spec, device="meta")).shards(num_shards)[index]
    materialize_(shard.module, seed=seed, weights=weights)
    return shard


def build_dense_part(spec: DLRMSpec, seed: int, weights: str | os.PathLike | None = None) -> Partition:
    """The DLRM's partition with only ``dense_part`` materialized (MLP weights, no table), from ``seed`` or the
    safetensors ``weights``.

    The embedding part stays on the meta device; it is there for its interface (``cut_names``, ``shards``).
    """
    partition = partition_embeddings(DLRM(spec, device="meta"))
    materialize_(partition.dense_part, seed=seed, weights=weights)
    return partition


def _is_embedding_op(root: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _EMBEDDING_MODULES)
    return node.op == "call_function" and node.target in _EMBEDDING_FUNCTIONS


def _is_parameter(root: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(_attribute(root, node.target), nn.Parameter)


def _attribute(root: nn.Module, target: str) -> Any:
    module_path, _, name = target.rpartition(".")
    return getattr(root.get_submodule(module_path), name)


def _parameter_free_function(root: fx.GraphModule, node: fx.Node) -> bool:
    """A function or method call that is no embedding lookup and reads no parameter."""
    return (
        node.op in _FUNCTION_OPS
        and not _is_embedding_op(root, node)
        and not any(_is_parameter(root, source) for source in node.all_input_nodes)
    )


def _input_only_nodes(root: fx.GraphModule, nodes: Iterable[fx.Node]) -> set[fx.Node]:
    found: set[fx.Node] = set()
    for node in nodes:
        if node.op in ("placeholder", "get_attr") or (
            _parameter_free_function(root, node) and all(source in found for source in node.all_input_nodes)
        ):
            found.add(node)
    return found


def _upstream(starts: Iterable[fx.Node], boundary: Iterable[fx.Node]) -> set[fx.Node]:
    """``starts`` and every node they depend on; ``boundary`` nodes are included when reached, not expanded."""
    boundary = set(boundary)
    found: set[fx.Node] = set()
    pending = list(starts)
    while pending:
        node = pending.pop()
        if node not in found:
            found.add(node)
            if node not in boundary:
                pending.extend(node.all_input_nodes)
    return found


def _request_inputs(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The placeholders ``nodes`` are computed from."""
    return {node for node in _upstream(nodes, ()) if node.op == "placeholder"}


def _absorb_forward(
    root: fx.GraphModule, nodes: Iterable[fx.Node], embedding_side: set[fx.Node], input_only: set[fx.Node]
) -> None:
    """Grows ``embedding_side`` in place by the forward rule of the module docstring."""
    read = _request_inputs(embedding_side)
    for node in nodes:
        if node in embedding_side or node in input_only or not _parameter_free_function(root, node):
            continue
        sources = node.all_input_nodes
        allowed = all(
            source in embedding_side or (source in input_only and _request_inputs([source]) <= read)
            for source in sources
        )
        frees_one = any(
            source in embedding_side and all(user is node or user in embedding_side for user in source.users)
            for source in sources
        )
        if allowed and frees_one:
            embedding_side.add(node)


def _extract(root: fx.GraphModule, outputs: Any, cut_inputs: Mapping[fx.Node, str], class_name: str) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` (nodes in any structure) from the nodes of ``root``'s graph.

    It copies only what ``outputs`` need; ``cut_inputs`` nodes and the original placeholders it reaches become
    placeholders (original inputs first, keeping their names). ``GraphModule`` keeps only the submodules and
    attributes the copy references, at their original qualified names.
    """
    leaves: list[fx.Node] = []
    fx.node.map_arg(outputs, leaves.append)
    needed = _upstream(leaves, cut_inputs)
    order = [node for node in root.graph.nodes if node in needed]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in order:
        if node in cut_inputs:
            env[node] = graph.placeholder(cut_inputs[node])
    for node in order:
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(fx.node.map_arg(outputs, env.__getitem__))
    return fx.GraphModule(root, graph, class_name=class_name)


def _placeholders(module: fx.GraphModule) -> tuple[str, ...]:
    return tuple(node.target for node in module.graph.nodes if node.op == "placeholder")


def _output_nodes(module: fx.GraphModule) -> dict[str, fx.Node]:
    output = next(node for node in module.graph.nodes if node.op == "output")
    return dict(output.args[0])


def _parameter_groups(module: fx.GraphModule) -> list[tuple[list[str], int]]:
    """``module``'s outputs grouped so that no parameter is shared across groups, with each group's bytes.

    Groups are ordered by their first output, so the stable sort in ``Partition.shards`` is deterministic.
    """
    groups: list[tuple[list[str], dict[int, nn.Parameter]]] = []
    for name, node in _output_nodes(module).items():
        parameters = {id(p): p for source in _upstream([node], ()) for p in _node_parameters(module, source)}
        shared = [index for index, (_, held) in enumerate(groups) if held.keys() & parameters.keys()]
        names: list[str] = []
        for index in shared:
            names += groups[index][0]
            parameters |= groups[index][1]
        names.append(name)
        position = shared[0] if shared else len(groups)
        groups = [group for index, group in enumerate(groups) if index not in shared]
        groups.insert(position, (names, parameters))
    return [(names, sum(p.numel() * p.element_size() for p in held.values())) for names, held in groups]


def _node_parameters(root: fx.GraphModule, node: fx.Node) -> list[nn.Parameter]:
    if node.op == "call_module":
        return list(root.get_submodule(node.target).parameters())
    if _is_parameter(root, node):
        return [_attribute(root, node.target)]
    return []
