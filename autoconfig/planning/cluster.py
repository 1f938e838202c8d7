"""The node list a plan places onto: each node's CPUs, memory (GiB), whole GPUs and GPU model.

Read from the openb CSV format (``sn,cpu_milli,memory_mib,gpu,model``: Alibaba's ``cluster-trace-gpu-v2023``) or a
YAML/JSON file ``{nodes: [{name, cpus, memory_gib, gpus, gpu_model, count}]}``. ``Cluster`` keeps the nodes as numpy
arrays in list order; ``prefix``, ``repeated`` and ``homogeneous`` build the clusters a benchmark sizes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from autoconfig.planning.inputs import PlanInputError, read_csv, read_document

OPENB_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
MIB_PER_GIB = 1024


@dataclass(frozen=True, order=True)
class NodeShape:
    """What one node offers."""

    cpus: float
    memory_gib: float
    gpus: int
    gpu_model: str = ""

    def describe(self) -> str:
        gpus = f", {self.gpus} x {self.gpu_model or 'GPU'}" if self.gpus else ", no GPU"
        return f"{self.cpus:g} CPUs, {self.memory_gib:g} GiB{gpus}"


@dataclass(frozen=True)
class Cluster:
    """Nodes in list order: ``names[i]`` offers ``cpus[i]`` CPUs, ``memory_gib[i]`` GiB and ``gpus[i]`` whole GPUs
    of model ``gpu_models[i]``."""

    names: tuple[str, ...]
    cpus: np.ndarray
    memory_gib: np.ndarray
    gpus: np.ndarray
    gpu_models: tuple[str, ...]

    @classmethod
    def from_shapes(cls, names: Sequence[str], shapes: Sequence[NodeShape]) -> Cluster:
        return cls(tuple(names), np.array([s.cpus for s in shapes], float),
                   np.array([s.memory_gib for s in shapes], float), np.array([s.gpus for s in shapes], int),
                   tuple(s.gpu_model for s in shapes))

    @classmethod
    def homogeneous(cls, counts: Sequence[tuple[NodeShape, int]], prefix: str = "node") -> Cluster:
        """``count`` nodes of each shape, in the order given, named ``<prefix>-<i>``."""
        shapes = [shape for shape, count in counts for _ in range(count)]
        return cls.from_shapes([f"{prefix}-{i}" for i in range(len(shapes))], shapes)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, index: int) -> NodeShape:
        return NodeShape(float(self.cpus[index]), float(self.memory_gib[index]), int(self.gpus[index]),
                         self.gpu_models[index])

    def shapes(self) -> list[NodeShape]:
        return [self.shape(i) for i in range(len(self))]

    def shape_counts(self) -> Counter[NodeShape]:
        return Counter(self.shapes())

    def prefix(self, count: int) -> Cluster:
        """The first ``count`` nodes."""
        return Cluster(self.names[:count], self.cpus[:count], self.memory_gib[:count], self.gpus[:count],
                       self.gpu_models[:count])

    def repeated(self, count: int) -> Cluster:
        """The first ``count`` nodes of the list repeated as often as needed; copies are named ``<name>#<copy>``."""
        n = len(self)
        index = np.arange(count) % n
        names = tuple(self.names[i] if k < n else f"{self.names[i]}#{k // n}" for k, i in enumerate(index))
        return Cluster(names, self.cpus[index], self.memory_gib[index], self.gpus[index],
                       tuple(self.gpu_models[i] for i in index))

    def totals(self) -> dict[str, float]:
        return {"cpus": float(self.cpus.sum()), "memory_gib": float(self.memory_gib.sum()),
                "gpus": float(self.gpus.sum())}

    def describe(self) -> dict[str, object]:
        """Node count, totals and the shapes with their counts (most common first)."""
        return {"nodes": len(self), **self.totals(),
                "shapes": [{"shape": shape.describe(), "nodes": count}
                           for shape, count in self.shape_counts().most_common()]}


def most_common_shape(cluster: Cluster, *, gpu: bool) -> tuple[NodeShape, int]:
    """The most common shape among the GPU nodes (``gpu``) or the CPU-only nodes, and its count (ties: the shape
    first in the list)."""
    counts = Counter(shape for shape in cluster.shapes() if (shape.gpus > 0) == gpu)
    if not counts:
        raise ValueError(f"the cluster has no {'GPU' if gpu else 'CPU-only'} node")
    return counts.most_common(1)[0]


class _NodeEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    cpus: float = Field(gt=0)
    memory_gib: float = Field(gt=0)
    gpus: int = Field(0, ge=0)
    gpu_model: str = ""
    count: int = Field(1, ge=1, description="Nodes of this shape, named <name>-<i> when more than one.")


class _NodeFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: list[_NodeEntry] = Field(min_length=1)


def read_nodes(path: str | Path) -> Cluster:
    """The node list in ``path``: ``.csv`` in the openb format (CPUs in milli, memory in MiB), otherwise YAML or
    JSON. A bad value is a :class:`PlanInputError` naming the file, line and column."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        names, shapes = [], []
        for row in read_csv(path, OPENB_COLUMNS):
            gpus = row.number("gpu")
            if not gpus.is_integer():
                raise row.error("gpu", f"{gpus:g} is not a whole number of GPUs")
            cpus, memory = row.number("cpu_milli") / 1000, row.number("memory_mib") / MIB_PER_GIB
            for column, value in (("cpu_milli", cpus), ("memory_mib", memory)):
                if value <= 0:
                    raise row.error(column, "must be > 0")
            names.append(row.text("sn"))
            shapes.append(NodeShape(cpus, memory, int(gpus), row.text("model", required=False)))
        if not shapes:
            raise PlanInputError(f"{path}: line 2: no node rows")
        return Cluster.from_shapes(names, shapes)
    document = read_document(path)
    listed = document.validate(_NodeFile)
    names, shapes = [], []
    for entry in listed.nodes:
        for i in range(entry.count):
            names.append(entry.name if entry.count == 1 else f"{entry.name}-{i}")
            shapes.append(NodeShape(entry.cpus, entry.memory_gib, entry.gpus, entry.gpu_model))
    return Cluster.from_shapes(names, shapes)
