"""Cutting any ``nn.Module`` once, after its embedding lookups, into a CPU half and a dense half (torch.fx).

``partition_embeddings`` makes the cut; ``embedding_lookups`` rewrites the embedding half to pool table rows
fetched elsewhere (a cache, a shard) through a per-batch deduplicated id index; ``build_dense_part`` builds the
dense half of a DLRM alone: the model is built on the meta device, cut, and only that part is materialized, with the
full model's values for the same seed (or the same trained weights file, of which only the part's tensors are read).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from disagg.model import DLRM, materialize_
from disagg.spec import DLRMSpec

_EMBEDDING_MODULES = (nn.Embedding, nn.EmbeddingBag)
_EMBEDDING_FUNCTIONS = (F.embedding, F.embedding_bag)
_FUNCTION_OPS = ("call_function", "call_method")


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


class TableIds(NamedTuple):
    """One table's ids in a batch, deduplicated over every embedding op that reads the table."""

    #: int64 [u]: the sorted unique ids
    ids: Tensor
    #: op name -> position in ``ids`` of each id that op was fed (its id tensor's shape and integer dtype)
    index: dict[str, Tensor]


@dataclass(frozen=True)
class EmbeddingLookups:
    """How the dense side computes an embedding part from table rows fetched elsewhere (a cache, a shard).

    Per batch: ``unique = lookups.unique_ids(inputs)``; fetch each table's rows, float32 ``[len(ids), dim]`` with row
    ``i`` the table's row ``unique[table].ids[i]``; ``lookups(inputs, unique, rows)`` then returns what
    ``embedding_part(**inputs)`` returns, bit for bit: each lookup runs the same kernel over the same rows in the
    same order, reading them through its inverse index.

    - ``ids(**{name: inputs[name] for name in inputs})`` returns ``{op name: id tensor that op is fed}``.
    - ``pool`` is the embedding part with each op ``op`` reading the placeholders ``rows_input(op)`` (its table's
      fetched rows) and ``index_input(op)`` (its ``TableIds.index``), plus ``padding_input(op)`` (the position of
      the module's ``padding_idx`` in the unique ids, None when absent) for the ops in ``padding``; its other
      placeholders are ``inputs``. It holds no table.
    - ``op_tables``: op name -> table (the embedding module's qualified name, e.g. ``"embeddings.3"``), in graph
      order; ``tables``: table -> ``(rows, dim)`` of its weight, in the part's module order; ``padding``: op name ->
      its module's ``padding_idx``, for the ``nn.EmbeddingBag`` ops that set one.
    """

    ids: fx.GraphModule
    pool: fx.GraphModule
    inputs: tuple[str, ...]
    op_tables: Mapping[str, str]
    tables: Mapping[str, tuple[int, int]]
    padding: Mapping[str, int]

    def unique_ids(self, inputs: Mapping[str, Tensor]) -> dict[str, TableIds]:
        """Per table, the sorted unique ids its ops are fed in this batch and each op's inverse index.

        One ``torch.unique`` over every table (ids offset by their table's position in a global id space), so the
        cost barely grows with the number of tables. Raises ValueError naming the table when an id is outside
        ``[0, rows)``.
        """
        fed = self.ids(**{name: inputs[name] for name in self.inputs})
        ops, space = self._id_space.ops, self._id_space
        sizes = [fed[op].numel() for op in ops]
        counts = torch.tensor(sizes)
        flat = torch.cat([fed[op].reshape(-1) for op in ops]).to(torch.int64)
        outside = (flat < 0) | (flat >= torch.repeat_interleave(space.op_rows, counts))
        if bool(outside.any()):
            first = int(outside.to(torch.uint8).argmax())
            op = ops[int(torch.searchsorted(counts.cumsum(0), torch.tensor(first), right=True))]
            table = self.op_tables[op]
            raise ValueError(f"table {table!r}: id {int(flat[first])} is outside its rows [0, {self.tables[table][0]})")
        ids, inverse = torch.unique(flat + torch.repeat_interleave(space.op_base, counts), sorted=True,
                                    return_inverse=True)
        bounds = torch.searchsorted(ids, space.bounds).tolist()
        parts = dict(zip(ops, inverse.split(sizes), strict=True))
        unique = {}
        for position, (table, table_ops) in enumerate(space.table_ops.items()):
            low, high = bounds[position], bounds[position + 1]
            index = {op: (parts[op] - low).reshape(fed[op].shape).to(fed[op].dtype) for op in table_ops}
            unique[table] = TableIds(ids[low:high] - space.base[position], index)
        return unique

    @functools.cached_property
    def _id_space(self) -> _IdSpace:
        return _IdSpace.of(self.tables, self.op_tables)

    def __call__(
        self, inputs: Mapping[str, Tensor], unique: Mapping[str, TableIds], rows: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """``{cut name: tensor}`` of the embedding part, pooled from ``rows[table]`` (row i: table row
        ``unique[table].ids[i]``). Raises ValueError naming a table whose rows are missing or not ``[u, dim]``."""
        for table, (_, dim) in self.tables.items():
            if table not in rows or table not in unique:
                raise ValueError(f"no unique ids or rows for table {table!r}")
            expected = (unique[table].ids.shape[0], dim)
            if tuple(rows[table].shape) != expected:
                raise ValueError(f"rows of table {table!r} are {tuple(rows[table].shape)}, expected {expected}")
        feeds = {name: inputs[name] for name in self.inputs}
        for op, table in self.op_tables.items():
            feeds[rows_input(op)] = rows[table]
            feeds[index_input(op)] = unique[table].index[op]
            if op in self.padding:
                feeds[padding_input(op)] = _position(unique[table].ids, self.padding[op])
        return self.pool(**feeds)


@dataclass(frozen=True)
class _IdSpace:
    """Every table's ids in one space: table ``i`` (in ``tables`` order) starts at ``base[i]``."""

    table_ops: dict[str, list[str]]  # table -> the ops reading it
    ops: list[str]  # every op, grouped by table in table order
    base: list[int]
    bounds: Tensor  # int64 [tables + 1]: base, then the end of the last table
    op_base: Tensor  # int64 [ops]: the base of each op's table
    op_rows: Tensor  # int64 [ops]: the rows of each op's table

    @classmethod
    def of(cls, tables: Mapping[str, tuple[int, int]], op_tables: Mapping[str, str]) -> _IdSpace:
        table_ops = {table: [op for op, used in op_tables.items() if used == table] for table in tables}
        ends = torch.tensor([rows for rows, _ in tables.values()], dtype=torch.int64).cumsum(0)
        base = [0, *ends.tolist()[:-1]]
        ops = [op for table_ops_ in table_ops.values() for op in table_ops_]
        position = {table: index for index, table in enumerate(tables)}
        op_base = torch.tensor([base[position[op_tables[op]]] for op in ops], dtype=torch.int64)
        op_rows = torch.tensor([tables[op_tables[op]][0] for op in ops], dtype=torch.int64)
        return cls(table_ops, ops, base, torch.tensor([*base, int(ends[-1])]), op_base, op_rows)


def rows_input(op: str) -> str:
    """The ``EmbeddingLookups.pool`` placeholder taking the fetched rows of embedding op ``op``'s table."""
    return f"{op}_rows"


def index_input(op: str) -> str:
    """The ``EmbeddingLookups.pool`` placeholder taking embedding op ``op``'s inverse index."""
    return f"{op}_index"


def padding_input(op: str) -> str:
    """The ``EmbeddingLookups.pool`` placeholder taking the position of op ``op``'s padding id among the unique ids."""
    return f"{op}_padding_idx"


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


def embedding_lookups(partition: Partition) -> EmbeddingLookups:
    """``partition``'s embedding part rewritten to pool fetched table rows (see ``EmbeddingLookups``).

    It reads no table value, so a meta partition (``build_dense_part``) works; build it once and reuse it per batch.
    Every embedding op must be an ``nn.Embedding`` or ``nn.EmbeddingBag`` module call without ``max_norm``
    (lookups with it rewrite the table); ``padding_idx`` is honoured. Anything else is a ValueError naming it.
    """
    root = partition.embedding_part
    nodes = list(root.graph.nodes)
    lookups = {node: _lookup(root, node) for node in nodes if _is_embedding_op(root, node)}
    op_tables = {op.name: lookup.table for op, lookup in lookups.items()}
    ids = _extract(root, {op.name: lookup.ids for op, lookup in lookups.items()}, {}, "EmbeddingIds",
                   keep_inputs=True)
    for node in ids.graph.nodes:
        if _is_embedding_op(ids, node):
            raise ValueError(f"the ids of an embedding lookup depend on the lookup {node.name!r}; the dense side "
                             "needs every lookup's ids before fetching rows")
    padding = {op.name: lookup.module.padding_idx for op, lookup in lookups.items()
               if isinstance(lookup.module, nn.EmbeddingBag) and lookup.module.padding_idx is not None}
    clash = set(partition.embedding_inputs) & {
        name for op in op_tables for name in (rows_input(op), index_input(op), padding_input(op))
    }
    if clash:
        raise ValueError(f"model inputs {sorted(clash)} clash with the placeholders of the rewritten lookups")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
    feeds = {op: (graph.placeholder(rows_input(op.name)), graph.placeholder(index_input(op.name)),
                  graph.placeholder(padding_input(op.name)) if op.name in padding else None) for op in lookups}
    for node in nodes:
        if node in lookups:
            env[node] = lookups[node].pooled(graph, *feeds[node], env.__getitem__)
        elif node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.eliminate_dead_code()
    pool = fx.GraphModule(root, graph, class_name="EmbeddingPool")
    read = sorted(name for name, _ in pool.named_parameters() if name.rpartition(".")[0] in op_tables.values())
    if read:
        raise ValueError(f"the embedding part reads {read} outside the lookups of their tables")
    used = set(op_tables.values())
    tables = {name: tuple(module.weight.shape) for name, module in root.named_modules() if name in used}
    return EmbeddingLookups(ids, pool, partition.embedding_inputs, op_tables, tables, padding)


def build_dense_part(spec: DLRMSpec, seed: int, weights: str | os.PathLike | None = None) -> Partition:
    """The DLRM's partition with only ``dense_part`` materialized (MLP weights, no table), from ``seed`` or the
    safetensors ``weights``.

    The embedding part stays on the meta device; it is there for its interface (``cut_names``, ``embedding_lookups``).
    """
    partition = partition_embeddings(DLRM(spec, device="meta"))
    materialize_(partition.dense_part, seed=seed, weights=weights)
    return partition


def _is_embedding_op(root: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _EMBEDDING_MODULES)
    return node.op == "call_function" and node.target in _EMBEDDING_FUNCTIONS


@dataclass(frozen=True)
class _Lookup:
    """One embedding module call of an embedding part: its table, module and graph arguments."""

    table: str
    module: nn.Embedding | nn.EmbeddingBag
    ids: fx.Node
    offsets: Any
    per_sample_weights: Any

    def pooled(self, graph: fx.Graph, rows: fx.Node, index: fx.Node, padding: fx.Node | None,
               env: Callable[[fx.Node], fx.Node]) -> fx.Node:
        """The module's own functional call, added to ``graph``, over ``rows`` read through ``index``."""
        if isinstance(self.module, nn.Embedding):  # padding_idx only shapes gradients: the forward is index_select
            return graph.call_function(F.embedding, (index, rows))
        kwargs = {
            "offsets": fx.node.map_arg(self.offsets, env),
            "mode": self.module.mode,
            "per_sample_weights": fx.node.map_arg(self.per_sample_weights, env),
            "include_last_offset": self.module.include_last_offset,
            "padding_idx": padding,
        }
        return graph.call_function(F.embedding_bag, (index, rows), kwargs)


def _lookup(root: fx.GraphModule, node: fx.Node) -> _Lookup:
    """The embedding op ``node`` as a ``_Lookup``; refuses functional lookups and ``max_norm``."""
    if node.op != "call_module":
        weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        source = weight.target if isinstance(weight, fx.Node) and weight.op == "get_attr" else node.name
        raise ValueError(
            f"F.{node.target.__name__} over {source!r}: the dense side pools fetched rows of tables named by their "
            "module; look the table up with an nn.Embedding / nn.EmbeddingBag module"
        )
    module = root.get_submodule(node.target)
    if module.max_norm is not None:
        raise ValueError(f"embedding module {node.target!r} sets max_norm, which renormalizes the table's rows as it "
                         "looks them up; rows fetched from elsewhere cannot follow")
    arguments = inspect.signature(module.forward).bind(*node.args, **node.kwargs).arguments
    return _Lookup(node.target, module, arguments["input"], arguments.get("offsets"),
                   arguments.get("per_sample_weights"))


def _position(ids: Tensor, value: int) -> int | None:
    """The position of ``value`` in the sorted ``ids``, None when absent."""
    at = int(torch.searchsorted(ids, value))
    return at if at < ids.shape[0] and int(ids[at]) == value else None


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


def _extract(
    root: fx.GraphModule, outputs: Any, cut_inputs: Mapping[fx.Node, str], class_name: str, keep_inputs: bool = False
) -> fx.GraphModule:
    """A GraphModule computing ``outputs`` (nodes in any structure) from the nodes of ``root``'s graph.

    It copies only what ``outputs`` need; ``cut_inputs`` nodes and the original placeholders it reaches (all of
    them with ``keep_inputs``) become placeholders (original inputs first, keeping their names). ``GraphModule``
    keeps only the submodules and attributes the copy references, at their original qualified names.
    """
    leaves: list[fx.Node] = []
    fx.node.map_arg(outputs, leaves.append)
    needed = _upstream(leaves, cut_inputs)
    if keep_inputs:
        needed |= {node for node in root.graph.nodes if node.op == "placeholder"}
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
