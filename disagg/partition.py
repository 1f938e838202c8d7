"""Cutting any ``nn.Module`` once, after its embedding lookups, into a CPU half and a dense half (torch.fx).

``partition_embeddings`` makes the cut; ``embedding_lookups`` rewrites the embedding half to pool table rows
fetched elsewhere (a cache, a shard) through a per-batch deduplicated id index; ``build_dense_part`` builds the
dense half of a model alone: its structure is built on the meta device, cut, and only that part is materialized, with
the full model's values (the same seed, or the same weights file, of which only the part's tensors are read).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from disagg.id_space import IdSpace

if TYPE_CHECKING:
    from disagg.model_source import ModelSource

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


class GroupIds(NamedTuple):
    """A batch's unique ids of the tables of one row width (an ``IdGroup``)."""

    #: int64 [u]: the sorted unique space ids (so by table in group order, then by id)
    ids: Tensor
    #: per table of the group, in group order: how many of ``ids`` are its
    counts: list[int]


class UniqueIds(NamedTuple):
    """A batch's ids deduplicated over every embedding op, by row width."""

    #: row width -> that group's unique ids
    groups: dict[int, GroupIds]
    #: op name -> position in its group's ``ids`` of each id the op was fed (its id tensor's shape and dtype)
    index: dict[str, Tensor]


@dataclass(frozen=True)
class EmbeddingLookups:
    """How the dense side computes an embedding part from table rows fetched elsewhere (a cache, a shard).

    Per batch: ``unique = lookups.unique_ids(inputs)``; fetch the rows of each width's unique ids, float32
    ``[len(ids), dim]`` with row ``i`` the row of space id ``unique.groups[dim].ids[i]`` (``space``); then
    ``lookups(inputs, unique, rows)`` returns what ``embedding_part(**inputs)`` returns, bit for bit: each lookup
    runs the same kernel over the same rows in the same order, reading them through its inverse index.

    - ``ids(**{name: inputs[name] for name in inputs})`` returns ``{op name: id tensor that op is fed}``.
    - ``pool`` is the embedding part with each op ``op`` reading the placeholders ``rows_input(dim)`` (the fetched
      rows of its table's width) and ``index_input(op)`` (its ``UniqueIds.index``), plus ``padding_input(op)``
      (the position of the module's ``padding_idx`` among the group's unique ids, None when absent) for the ops in
      ``padding``; its other placeholders are ``inputs``. Bags of one width, mode and weighting fed 2-D ids run as
      one ``embedding_bag`` call (``pool_bags``). It holds no table.
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

    @functools.cached_property
    def space(self) -> IdSpace:
        """The id space of ``tables``."""
        return IdSpace.of(self.tables)

    def unique_ids(self, inputs: Mapping[str, Tensor]) -> UniqueIds:
        """The sorted unique ids of each width's tables in this batch and each op's inverse index.

        One ``torch.unique`` over every table (ids offset into the ``space``), so the cost barely grows with the
        number of tables. Raises ValueError naming the table when an id is outside ``[0, rows)``.
        """
        fed = self.ids(**{name: inputs[name] for name in self.inputs})
        flat, sizes, repeats = self._flat_ids(fed)
        ids, inverse = torch.unique(flat + repeats.base, sorted=True, return_inverse=True)
        table_counts = torch.searchsorted(ids, self._plan.table_bounds).diff().tolist()
        groups: dict[int, GroupIds] = {}
        first_table = start = 0
        for group in self.space.groups:
            counts_of_group = table_counts[first_table:first_table + len(group.tables)]
            stop = start + sum(counts_of_group)
            groups[group.dim] = GroupIds(ids[start:stop], counts_of_group)
            first_table, start = first_table + len(group.tables), stop
        if len(groups) > 1:  # positions within each op's width group: minus where the group's run starts
            group_starts = torch.tensor([0, *itertools.accumulate(len(groups[dim].ids) for dim in groups)][:-1])
            inverse = inverse - group_starts[repeats.group]
        ops = self._plan.ops
        first = fed[ops[0]]
        if all(fed[op].shape == first.shape and fed[op].dtype == first.dtype for op in ops):  # the usual case
            index = dict(zip(ops, inverse.to(first.dtype).view(len(ops), *first.shape).unbind(0), strict=True))
        else:
            index = {op: positions.view(fed[op].shape).to(fed[op].dtype)
                     for op, positions in zip(ops, inverse.split(sizes), strict=True)}
        return UniqueIds(groups, index)

    def table_ids(self, unique: UniqueIds, table: str) -> Tensor:
        """Table ``table``'s sorted unique ids in ``unique``, as its own row numbers."""
        dim = self.tables[table][1]
        group = next(group for group in self.space.groups if group.dim == dim)
        position = group.tables.index(table)
        counts = unique.groups[dim].counts
        start = sum(counts[:position])
        return unique.groups[dim].ids[start:start + counts[position]] - self.space.base[table]

    def pool_tables(self, inputs: Mapping[str, Tensor], tables: Mapping[int, Tensor]) -> dict[str, Tensor]:
        """``embedding_part(**inputs)`` from whole tables: ``tables[dim]`` stacks every table of that width in space
        order (``stack_tables``). No deduplication; one call per fused set of bags. ValueError names the table of an
        id outside its rows."""
        fed = self.ids(**{name: inputs[name] for name in self.inputs})
        plan = self._plan
        flat, sizes, repeats = self._flat_ids(fed)
        shifted = flat + repeats.shift
        feeds = {name: inputs[name] for name in self.inputs}
        for group in self.space.groups:
            feeds[rows_input(group.dim)] = tables[group.dim]
        for at, (op, index) in enumerate(zip(plan.ops, shifted.split(sizes), strict=True)):
            feeds[index_input(op)] = index.view(fed[op].shape)
            if op in self.padding:
                feeds[padding_input(op)] = int(plan.op_shift[at]) + self.padding[op]
        return self.pool(**feeds)

    def _flat_ids(self, fed: Mapping[str, Tensor]) -> tuple[Tensor, list[int], _Repeats]:
        """Every op's ids in one int64 tensor (ops in plan order), the sizes, and the per-id repeats of the ops'
        constants; ValueError names the table of an id outside its rows."""
        plan = self._plan
        sizes = [fed[op].numel() for op in plan.ops]
        repeats = self._repeats(sizes)
        fed_ids = [fed[op] for op in plan.ops]
        head = fed_ids[0]
        uniform = all(ids.shape == head.shape and ids.dtype == head.dtype for ids in fed_ids)
        flat = (torch.stack(fed_ids).reshape(-1) if uniform else torch.cat([ids.reshape(-1) for ids in fed_ids])
                ).to(torch.int64)
        outside = (flat < 0) | (flat >= repeats.rows)
        if bool(outside.any()):
            first = int(outside.to(torch.uint8).argmax())
            op = plan.ops[bisect.bisect_right(list(itertools.accumulate(sizes)), first)]
            table = self.op_tables[op]
            raise ValueError(f"table {table!r}: id {int(flat[first])} is outside its rows [0, {self.tables[table][0]})")
        return flat, sizes, repeats

    def _repeats(self, sizes: list[int]) -> _Repeats:
        """The ops' constants repeated over their ids for ops fed ``sizes`` ids; kept per sizes seen (a batch's
        shape recurs), at most ``_MAX_REPEATS`` of them."""
        key = tuple(sizes)
        cache = self._repeats_seen
        repeats = cache.get(key)
        if repeats is None:
            if len(cache) >= _MAX_REPEATS:
                cache.clear()
            plan, counts = self._plan, torch.tensor(sizes)
            repeats = cache[key] = _Repeats(*(torch.repeat_interleave(values, counts) for values in (
                plan.op_base, plan.op_rows, plan.op_shift, plan.op_group)))
        return repeats

    @functools.cached_property
    def _repeats_seen(self) -> dict[tuple[int, ...], _Repeats]:
        return {}

    @functools.cached_property
    def _plan(self) -> _OpPlan:
        return _OpPlan.of(self.space, self.op_tables, self.tables)

    def __call__(
        self, inputs: Mapping[str, Tensor], unique: UniqueIds, rows: Mapping[int, Tensor]
    ) -> dict[str, Tensor]:
        """``{cut name: tensor}`` of the embedding part, pooled from ``rows[dim]`` (row i: the row of space id
        ``unique.groups[dim].ids[i]``). Raises ValueError naming a width whose rows are missing or misshapen."""
        feeds = {name: inputs[name] for name in self.inputs}
        for group in self.space.groups:
            if group.dim not in rows or group.dim not in unique.groups:
                raise ValueError(f"no unique ids or rows for the tables of width {group.dim}")
            expected = (unique.groups[group.dim].ids.shape[0], group.dim)
            if tuple(rows[group.dim].shape) != expected:
                raise ValueError(f"rows of width {group.dim} are {tuple(rows[group.dim].shape)}, expected {expected}")
            feeds[rows_input(group.dim)] = rows[group.dim]
        for op, table in self.op_tables.items():
            feeds[index_input(op)] = unique.index[op]
            if op in self.padding:
                dim = self.tables[table][1]
                feeds[padding_input(op)] = _position(unique.groups[dim].ids, self.space.base[table] + self.padding[op])
        return self.pool(**feeds)


@dataclass(frozen=True)
class _OpPlan:
    """The ops in space order (grouped by table, tables in space order) with what ``unique_ids`` needs of each."""

    ops: list[str]
    op_base: Tensor  # int64 [ops]: the first space id of each op's table
    op_rows: Tensor  # int64 [ops]: the rows of each op's table
    op_shift: Tensor  # int64 [ops]: the first row of each op's table in its width's stack
    op_group: Tensor  # int64 [ops]: the position of each op's width group in the space
    table_bounds: Tensor  # int64 [tables + 1] in space order

    @classmethod
    def of(cls, space: IdSpace, op_tables: Mapping[str, str], tables: Mapping[str, tuple[int, int]]) -> _OpPlan:
        ops = [op for table in space.tables for op, used in op_tables.items() if used == table]
        start = {table: group.start for group in space.groups for table in group.tables}
        group_of = {table: at for at, group in enumerate(space.groups) for table in group.tables}
        return cls(ops, torch.tensor([space.base[op_tables[op]] for op in ops], dtype=torch.int64),
                   torch.tensor([space.rows[op_tables[op]] for op in ops], dtype=torch.int64),
                   torch.tensor([space.base[op_tables[op]] - start[op_tables[op]] for op in ops], dtype=torch.int64),
                   torch.tensor([group_of[op_tables[op]] for op in ops], dtype=torch.int64),
                   space.bounds(space.tables))


class _Repeats(NamedTuple):
    """``_OpPlan``'s per-op constants repeated over each op's ids (int64, one entry per id of the flat ids)."""

    base: Tensor
    rows: Tensor
    shift: Tensor
    group: Tensor


#: the most id-size patterns ``EmbeddingLookups`` keeps repeats for (one per batch shape seen)
_MAX_REPEATS = 256


def rows_input(dim: int) -> str:
    """The ``EmbeddingLookups.pool`` placeholder taking the fetched rows of the tables of width ``dim``."""
    return f"rows_{dim}"


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
    used = set(op_tables.values())
    tables = {name: tuple(module.weight.shape) for name, module in root.named_modules() if name in used}
    dims = list(dict.fromkeys(dim for _, dim in tables.values()))
    clash = set(partition.embedding_inputs) & {
        *(rows_input(dim) for dim in dims),
        *(name for op in op_tables for name in (index_input(op), padding_input(op))),
    }
    if clash:
        raise ValueError(f"model inputs {sorted(clash)} clash with the placeholders of the rewritten lookups")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
    rows = {dim: graph.placeholder(rows_input(dim)) for dim in dims}
    feeds = {op: (rows[tables[lookup.table][1]], graph.placeholder(index_input(op.name)),
                  graph.placeholder(padding_input(op.name)) if op.name in padding else None)
             for op, lookup in lookups.items()}
    for node in nodes:
        if node in lookups:
            env[node] = lookups[node].pooled(graph, *feeds[node], env.__getitem__)
        elif node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.eliminate_dead_code()
    _fuse_bags(graph)
    pool = fx.GraphModule(root, graph, class_name="EmbeddingPool")
    read = sorted(name for name, _ in pool.named_parameters() if name.rpartition(".")[0] in op_tables.values())
    if read:
        raise ValueError(f"the embedding part reads {read} outside the lookups of their tables")
    return EmbeddingLookups(ids, pool, partition.embedding_inputs, op_tables, tables, padding)


def pool_bags(rows: Tensor, indices: tuple[Tensor, ...], per_sample_weights: tuple[Tensor, ...] | None, mode: str
              ) -> tuple[Tensor, ...]:
    """``F.embedding_bag(indices[k], rows, mode=mode, per_sample_weights=per_sample_weights[k])`` for every ``k``
    (2-D ``indices``), in one call when they have one bag size: a bag's result does not depend on its neighbours."""
    if len({index.shape[1] for index in indices}) == 1:
        weights = None if per_sample_weights is None else torch.cat(per_sample_weights)
        pooled = F.embedding_bag(torch.cat(indices), rows, mode=mode, per_sample_weights=weights)
        return pooled.split([index.shape[0] for index in indices])
    return tuple(F.embedding_bag(index, rows, mode=mode,
                                 per_sample_weights=None if per_sample_weights is None else per_sample_weights[k])
                 for k, index in enumerate(indices))


def _fuse_bags(graph: fx.Graph) -> None:
    """Replaces the ``F.embedding_bag`` calls over 2-D ids (no offsets, no padding) that share rows, mode and
    weighting with one ``pool_bags`` call after the last of them, leaving out any whose output is used earlier."""
    nodes = list(graph.nodes)
    position = {node: at for at, node in enumerate(nodes)}
    sets: dict[tuple[fx.Node, str, bool], list[fx.Node]] = {}
    for node in nodes:
        if (node.op == "call_function" and node.target is F.embedding_bag and node.kwargs["offsets"] is None
                and node.kwargs["padding_idx"] is None and not node.kwargs["include_last_offset"]):
            key = (node.args[1], node.kwargs["mode"], node.kwargs["per_sample_weights"] is None)
            sets.setdefault(key, []).append(node)
    for (rows, mode, unweighted), members in sets.items():
        while members and any(position[user] <= position[members[-1]] for member in members for user in member.users):
            members = [member for member in members
                       if all(position[user] > position[members[-1]] for user in member.users)]
        if len(members) < 2:
            continue
        weights = None if unweighted else tuple(member.kwargs["per_sample_weights"] for member in members)
        with graph.inserting_after(members[-1]):
            fused = graph.call_function(pool_bags, (rows, tuple(member.args[0] for member in members), weights, mode))
        previous = fused
        for k, member in enumerate(members):
            with graph.inserting_after(previous):
                previous = graph.call_function(operator.getitem, (fused, k))
            member.replace_all_uses_with(previous)
            graph.erase_node(member)
    graph.lint()


def build_dense_part(source: ModelSource) -> Partition:
    """The model's partition with only ``dense_part`` materialized (no table): its values seeded, or read from the
    weights file (only the part's tensors).

    The embedding part keeps the structure's meta tables; it is there for its interface (``cut_names``,
    ``embedding_lookups``).
    """
    partition = partition_embeddings(source.skeleton())
    source.materialize(partition.dense_part)
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
