"""What a plan places: instances (replicas) with a resource vector, read from a trace or from measured pools.

Two sources:

- a trace in the format of Prism's ``disaggregated_DLRM_trace.csv`` (Alibaba ``cluster-trace-gpu-v2025``): one row
  per instance, ``role`` CN (CPU-node side: embeddings) or HN (GPU-node side: dense part), the CPUs, GPUs and memory
  (GiB) it requests, ``max_instance_per_node`` (most instances of its ``app_name`` on one node; -1: no limit) and
  its creation and deletion times. ``select`` keeps the instances alive at one moment (the busiest by default).
  The disaggregated layout places the rows as they are; the monolithic layout fuses them (``fuse``: each HN
  instance takes an even share of its service's CN CPUs and memory; services with no HN instance stay CPU-only).
- a service file (YAML or JSON) of pools measured by ``autoconfig profile``: per pool the deployment, per-replica
  CPUs, GPU share and memory, and either a replica count or the sustainable rate of one replica (given, or read
  from a profile-bank entry) with the service's target rate: replicas = ceil(target / rate per replica).

Format of the service file and the rules: docs/AUTOCONFIG.md ("Planning a cluster").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from autoconfig.bank import BankEntry, BankError
from autoconfig.planning.inputs import Document, PlanInputError, read_csv, read_document

Layout = Literal["monolithic", "disaggregated"]
LAYOUTS: tuple[Layout, ...] = ("monolithic", "disaggregated")
TRACE_COLUMNS = ("instance_sn", "role", "app_name", "cpu_request", "gpu_request", "memory_request",
                 "max_instance_per_node", "creation_time", "deletion_time")
#: How the monolithic layout of a trace service is made (stated in plan results and docs).
FUSION_RULE = ("each GPU-node (HN) instance of a service is fused with an even share of the service's CPU-node (CN) "
               "instances: it requests its own CPUs, memory and GPUs plus (the service's total CN CPUs and memory) / "
               "(its number of HN instances), and keeps its max_instance_per_node; a service with no HN instance "
               "keeps its CN instances as they are (CPU-only)")


@dataclass(frozen=True)
class Instance:
    """One replica to place. ``gpus`` is a number of whole GPUs (>= 1) or a share of one GPU (< 1);
    ``max_per_node`` bounds the instances of ``group`` on one node (None: no bound)."""

    name: str
    service: str
    pool: str
    cpus: float
    memory_gib: float
    gpus: float = 0.0
    group: str = ""
    max_per_node: int | None = None

    @property
    def shape(self) -> tuple[float, float, float]:
        return (self.cpus, self.memory_gib, self.gpus)


@dataclass(frozen=True)
class Pool:
    """A measured pool sized for its service: ``replicas`` replicas of ``deployment``, or with ``shards`` of each of
    the deployments ``<deployment>_<i>``, i < shards."""

    service: str
    app: str | None
    deployment: str
    shards: int | None
    replicas: int
    cpus: float
    memory_gib: float
    gpus: float
    max_per_node: int | None
    rate_per_replica: float | None

    def deployments(self) -> list[str]:
        return [self.deployment] if self.shards is None else [f"{self.deployment}_{i}" for i in range(self.shards)]


@dataclass(frozen=True)
class Workload:
    """The instances of one layout, in the order they are placed, and how they were chosen."""

    layout: Layout
    instances: tuple[Instance, ...]
    pools: tuple[Pool, ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)

    def demand(self) -> dict[str, float]:
        return {"cpus": sum(i.cpus for i in self.instances), "memory_gib": sum(i.memory_gib for i in self.instances),
                "gpus": sum(i.gpus for i in self.instances)}


# --- traces ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRow:
    """One instance of a Prism-format trace; times in seconds from the trace start (None: before the start for
    ``created``, after the end for ``deleted``)."""

    name: str
    role: Literal["CN", "HN"]
    app: str
    cpus: float
    gpus: float
    memory_gib: float
    max_per_node: int | None
    created: float | None
    deleted: float | None


def _gpu_request(value: float) -> bool:
    return value < 1 or value.is_integer()


def read_trace(path: str | Path) -> list[TraceRow]:
    """Every row of a Prism-format trace CSV, in file order; a bad cell is a :class:`PlanInputError` naming its
    line and column."""
    rows = []
    for row in read_csv(path, TRACE_COLUMNS):
        role = row.text("role", choices=("CN", "HN"))
        gpus = row.number("gpu_request")
        if not _gpu_request(gpus):
            raise row.error("gpu_request", f"{gpus:g}: a share of one GPU (< 1) or a whole number of GPUs")
        if role == "HN" and gpus == 0:
            raise row.error("gpu_request", "0 for an HN (GPU-node) instance")
        limit = row.number("max_instance_per_node", minimum=-1)
        if not limit.is_integer() or limit == 0:
            raise row.error("max_instance_per_node", f"{limit:g}: a whole number >= 1, or -1 for no limit")
        created, deleted = row.number("creation_time", empty=-1.0), row.number("deletion_time", empty=-1.0)
        rows.append(TraceRow(row.text("instance_sn"), role, row.text("app_name"), row.number("cpu_request"), gpus,
                             row.number("memory_request"), None if limit < 0 else int(limit),
                             None if created < 0 else created, None if deleted < 0 else deleted))
    if not rows:
        raise PlanInputError(f"{path}: line 2: no instance rows")
    return rows


def _lifetimes(rows: Sequence[TraceRow]) -> tuple[np.ndarray, np.ndarray]:
    created = np.array([-np.inf if r.created is None else r.created for r in rows])
    deleted = np.array([np.inf if r.deleted is None else r.deleted for r in rows])
    return created, deleted


def busiest_moment(rows: Sequence[TraceRow]) -> tuple[float | None, int]:
    """The earliest moment with the most instances alive (created at or before it, deleted after it) and that
    count; None for the trace start (before any creation in the trace)."""
    created, deleted = _lifetimes(rows)
    moments = np.unique(np.concatenate([[-np.inf], created[np.isfinite(created)]]))
    alive = (np.searchsorted(np.sort(created), moments, side="right")
             - np.searchsorted(np.sort(deleted), moments, side="right"))
    best = int(np.argmax(alive))
    moment = float(moments[best])
    return (None if moment == -np.inf else moment), int(alive[best])


def select(rows: Sequence[TraceRow], moment: str = "busiest") -> tuple[list[TraceRow], dict[str, Any]]:
    """The rows to place, in creation order (rows created before the trace start first, then file order), and how
    they were chosen: ``busiest`` (alive at the busiest moment), ``all``, or a time in seconds (alive then)."""
    if moment == "all":
        chosen, note = list(rows), {"moment": "all", "rule": "every instance of the trace"}
    else:
        if moment == "busiest":
            at, _ = busiest_moment(rows)
            rule = "the instances alive at the trace's busiest moment (the most instances alive at once)"
        else:
            try:
                at = float(moment)
            except ValueError:
                raise PlanInputError(f"--moment {moment!r}: busiest, all, or a time in seconds") from None
            rule = "the instances alive at the given moment"
        created, deleted = _lifetimes(rows)
        t = -np.inf if at is None else at
        keep = (created <= t) & (deleted > t)
        chosen = [row for row, alive in zip(rows, keep, strict=True) if alive]
        note = {"moment": "trace start" if at is None else at, "rule": rule + "; alive = created at or before it "
                "(or before the trace start) and deleted after it (or after the trace end)"}
    order = sorted(range(len(chosen)), key=lambda i: (-np.inf if chosen[i].created is None else chosen[i].created, i))
    return [chosen[i] for i in order], {**note, "instances": len(chosen)}


def _instance(row: TraceRow, pool: str, extra_cpus: float = 0.0, extra_memory: float = 0.0) -> Instance:
    return Instance(row.name, row.app, pool, row.cpus + extra_cpus, row.memory_gib + extra_memory, row.gpus,
                    group=row.app, max_per_node=row.max_per_node)


def fuse(rows: Sequence[TraceRow]) -> list[Instance]:
    """The monolithic layout of trace rows (``FUSION_RULE``), in the rows' order."""
    hn_count: dict[str, int] = defaultdict(int)
    cn_cpus: dict[str, float] = defaultdict(float)
    cn_memory: dict[str, float] = defaultdict(float)
    for row in rows:
        if row.role == "HN":
            hn_count[row.app] += 1
        else:
            cn_cpus[row.app] += row.cpus
            cn_memory[row.app] += row.memory_gib
    fused = []
    for row in rows:
        if row.role == "HN":
            share = hn_count[row.app]
            fused.append(_instance(row, "fused", cn_cpus[row.app] / share, cn_memory[row.app] / share))
        elif hn_count[row.app] == 0:
            fused.append(_instance(row, "CN"))
    return fused


def trace_workload(rows: Sequence[TraceRow], layout: Layout, notes: dict[str, Any] | None = None) -> Workload:
    """The selected trace rows as a layout's instances: disaggregated as they are (pools CN and HN), monolithic
    fused (pools ``fused`` and, for services with no HN instance, CN)."""
    instances = fuse(rows) if layout == "monolithic" else [_instance(row, row.role) for row in rows]
    notes = dict(notes or {})
    if layout == "monolithic":
        notes["fusion_rule"] = FUSION_RULE
    return Workload(layout, tuple(instances), notes=notes)


# --- measured pools ----------------------------------------------------------------------------------------------

class PoolSpec(BaseModel):
    """A pool of one service as the service file gives it."""

    model_config = ConfigDict(extra="forbid")

    deployment: str = Field(min_length=1, description="The Serve deployment (with shards: the name before _<i>).")
    shards: int | None = Field(None, ge=1, le=64, description="Deployments <deployment>_<i>, i < shards (embedding "
                               "shards), of replicas each.")
    cpus: float | None = Field(None, ge=0, description="CPUs per replica.")
    gpus: float | None = Field(None, ge=0, description="GPUs per replica: a share (< 1) or whole GPUs.")
    memory_gib: float | None = Field(None, ge=0, description="Memory per replica, GiB.")
    replicas: int | None = Field(None, ge=1, description="Replicas of each deployment (instead of a rate).")
    rate_per_replica: float | None = Field(None, gt=0, description="Sustainable requests/s of one replica.")
    max_per_node: int | None = Field(None, ge=1, description="Most replicas of this pool on one node.")
    profile: str | None = Field(None, description="A profile-bank entry (JSON) to read the rest from.")
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="What the profile's device_share is.")

    @model_validator(mode="after")
    def _whole_gpus_above_one(self) -> PoolSpec:
        if self.gpus is not None and not _gpu_request(self.gpus):
            raise ValueError(f"gpus: {self.gpus:g}: a share of one GPU (< 1) or a whole number of GPUs")
        if self.replicas is not None and self.rate_per_replica is not None:
            raise ValueError("give replicas or rate_per_replica, not both")
        return self


class ServiceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    app: str | None = Field(None, description="The Serve application of --template this service is.")
    target_rps: float | None = Field(None, gt=0, description="Requests/s the service must sustain.")
    layouts: dict[Layout, list[PoolSpec]] = Field(min_length=1)


class ServiceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    services: list[ServiceSpec] = Field(min_length=1)


def profiled_pool(path: Path, accelerator: str) -> dict[str, float]:
    """Per-replica resources and rate of the best configuration of a profile-bank entry (the highest objective,
    repeated configurations at the mean of their runs): its trial's rate over its ``num_replicas``, its
    ``device_share`` as CPUs (``cpu``) or GPUs (``gpu``), and its replicas' measured memory over ``num_replicas``
    when recorded. Raises :class:`BankError` for an entry without those."""
    entry = BankEntry.load(path)
    measured = entry.measured()
    best = max(measured, key=lambda config: measured[config], default=None)
    if best is None or measured[best] <= 0:
        raise BankError(f"{path}: no configuration held a rate within its SLO")
    knobs = best.as_dict()
    if "num_replicas" not in knobs or "device_share" not in knobs:
        raise BankError(f"{path}: its configurations have no num_replicas and device_share knobs")
    trial = next(trial for trial in entry.trials if trial.config == best)
    replicas = knobs["num_replicas"]
    values = {"rate_per_replica": (trial.rps or 0.0) / replicas,
              "cpus" if accelerator == "cpu" else "gpus": float(knobs["device_share"])}
    if trial.memory_mib is not None:
        values["memory_gib"] = trial.memory_mib / replicas / 1024
    return values


def _resolve(document: Document, spec: ServiceSpec, pool: PoolSpec, loc: tuple[Any, ...]) -> Pool:
    values = pool.model_dump(exclude_none=True)
    if pool.profile is not None:
        path = Path(pool.profile)
        if not path.is_absolute():
            path = document.path.parent / path
        try:
            values = profiled_pool(path, pool.accelerator) | values
        except BankError as exc:
            raise document.error((*loc, "profile"), f"profile: {exc}") from None
    for name in ("cpus", "memory_gib"):
        if name not in values:
            raise document.error(loc, f"{name}: needed (give it, or a profile that measured it)")
    if pool.replicas is not None:
        replicas = pool.replicas
    elif "rate_per_replica" not in values:
        raise document.error(loc, "replicas or rate_per_replica (or a profile) is needed")
    elif spec.target_rps is None:
        raise document.error(loc[:2], f"target_rps: needed to size {pool.deployment} from its rate per replica")
    else:
        replicas = max(1, math.ceil(spec.target_rps / values["rate_per_replica"] - 1e-9))
    gpus = values.get("gpus", 0.0)
    if not _gpu_request(gpus):
        raise document.error(loc, f"gpus: {gpus:g} from the profile: a share of one GPU (< 1) or whole GPUs")
    return Pool(spec.name, spec.app, pool.deployment, pool.shards, replicas, values["cpus"], values["memory_gib"],
                gpus, pool.max_per_node, values.get("rate_per_replica"))


def pool_instances(pools: Iterable[Pool]) -> list[Instance]:
    """Every replica of the pools, pool by pool, each deployment's replicas together."""
    instances = []
    for pool in pools:
        for deployment in pool.deployments():
            instances += [Instance(f"{pool.service}/{deployment}/{r}", pool.service, deployment, pool.cpus,
                                   pool.memory_gib, pool.gpus, group=f"{pool.service}/{pool.deployment}",
                                   max_per_node=pool.max_per_node) for r in range(pool.replicas)]
    return instances


def read_services(path: str | Path, layout: Layout) -> Workload:
    """The pools of every service of a service file in ``layout``, sized and expanded into instances. A bad value
    (or a service without that layout) is a :class:`PlanInputError` naming the file, line and column."""
    document = read_document(path)
    services = document.validate(ServiceFile)
    apps = [spec.app for spec in services.services if spec.app is not None]
    if len(set(apps)) != len(apps):
        repeated = next(app for app in apps if apps.count(app) > 1)
        index = [spec.app for spec in services.services].index(repeated, apps.index(repeated) + 1)
        raise document.error(("services", index, "app"), f"services[{index}].app: {repeated!r} is another "
                             "service's application already")
    pools = []
    for index, spec in enumerate(services.services):
        if layout not in spec.layouts:
            raise document.error(("services", index, "layouts"), f"services[{index}].layouts: no {layout} layout "
                                 f"for service {spec.name!r}")
        for number, pool in enumerate(spec.layouts[layout]):
            pools.append(_resolve(document, spec, pool, ("services", index, "layouts", layout, number)))
    return Workload(layout, tuple(pool_instances(pools)), tuple(pools),
                    notes={"source": str(path), "rule": "replicas = ceil(target_rps / rate_per_replica) per pool"})


def is_trace(path: str | Path) -> bool:
    """Whether a service file is a trace (CSV) rather than a YAML/JSON file of measured pools."""
    return Path(path).suffix.lower() == ".csv"
