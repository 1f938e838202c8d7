"""GPU shares: what a replica's share of a GPU sets in each ``GpuShareMode``, which mode a tuning run uses, and
configs whose shares overflow a GPU.

A fractional ``num_gpus`` only schedules; the memory fraction caps memory; compute is divided only under an MPS
control daemon on the node, which caps each process at its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
(docs/DEPLOYMENT.md, "Dividing a GPU with MPS").
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ray.serve.schema import ServeDeploySchema

#: What a GPU ``device_share`` divides: ``mps`` compute (MPS thread percentage) and memory, ``memory`` memory only
#: (compute is time-sliced), ``schedule`` nothing (Ray's fractional ``num_gpus`` alone).
GpuShareMode = Literal["mps", "memory", "schedule"]
CUDA_MEMORY_FRACTION_ENV = "SWIFTSERVE_CUDA_MEMORY_FRACTION"
MPS_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_CONTROL = "nvidia-cuda-mps-control"
#: Ray counts fractional resources in units of 1e-4.
_RESOURCE_UNITS = 10_000


def gpu_share_env(share: float, mode: GpuShareMode) -> dict[str, str]:
    """The environment a replica holding ``share`` of a GPU gets in ``mode``: its memory fraction (``mps``,
    ``memory``) and its MPS thread percentage (``mps``), each of ``min(share, 1)``."""
    fraction = min(share, 1.0)
    env = {} if mode == "schedule" else {CUDA_MEMORY_FRACTION_ENV: str(fraction)}
    if mode == "mps":
        env[MPS_PERCENTAGE_ENV] = str(max(1, round(100 * fraction)))
    return env


class GpuShareError(ValueError):
    """A GPU share mode this cluster cannot honour, named with the flag."""


def mps_daemon_answers(timeout_s: float = 5.0) -> str | None:
    """None when an MPS control daemon answers on this node (``get_server_list`` through its control pipe), else
    why not."""
    control = shutil.which(MPS_CONTROL)
    if control is None:
        return f"{MPS_CONTROL} is not on PATH"
    try:
        answer = subprocess.run([control], input="get_server_list\n", capture_output=True, text=True,
                                timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{MPS_CONTROL} did not answer within {timeout_s:g} s"
    if answer.returncode:
        said = (answer.stderr or answer.stdout).strip() or "no output"
        return f"no MPS control daemon answers ({MPS_CONTROL}: exit {answer.returncode}, {said})"
    return None


def gpu_nodes_without_mps() -> dict[str, str]:
    """Every alive GPU node of the connected Ray cluster whose MPS control daemon does not answer, with why (a task
    pinned to each node asks it); ``{}`` when all answer. Raises GpuShareError when the cluster has no GPU node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU", 0) > 0]
    if not nodes:
        raise GpuShareError("--accelerator gpu: the Ray cluster has no GPU node")
    ask = ray.remote(num_cpus=0)(mps_daemon_answers)
    answers = ray.get([ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                       for node in nodes])
    return {node: reason for node, reason in zip(nodes, answers, strict=True) if reason is not None}


def resolve_gpu_share_mode(requested: GpuShareMode | None,
                           nodes_without_mps: Callable[[], Mapping[str, str]]) -> tuple[GpuShareMode, str | None]:
    """The mode a GPU tuning run uses and a warning to show: ``requested``, or by default ``mps`` when every GPU
    node's daemon answers, else ``memory`` (warned: compute is then time-sliced, not divided). GpuShareError for
    ``mps`` where a node's daemon does not answer."""
    if requested in ("memory", "schedule"):
        return requested, None
    missing = nodes_without_mps()
    if not missing:
        return "mps", None
    named = "; ".join(f"node {node}: {reason}" for node, reason in sorted(missing.items()))
    if requested == "mps":
        raise GpuShareError(f"--gpu-share-mode mps: {named}; start the daemon on every GPU node "
                            "(docs/DEPLOYMENT.md, 'Dividing a GPU with MPS') or pass --gpu-share-mode memory")
    return "memory", (f"--gpu-share-mode memory: device_share divides GPU memory, not compute (processes sharing a "
                      f"GPU are time-sliced), since not every GPU node runs an MPS control daemon ({named})")


@dataclass(frozen=True)
class _GpuReplica:
    """One replica of a deployment holding part of a GPU: what Ray schedules and what it claims of the device."""

    deployment: str
    num_gpus: float
    claim: float  # the larger of its memory fraction and MPS thread share (its num_gpus when neither is set)


def gpu_overcommit(config: ServeDeploySchema) -> str | None:
    """None, or what overflows: replicas Ray may place on one GPU (their fractional ``num_gpus`` summing to at most
    1) whose memory fractions or MPS thread percentages sum past 1 of it, named by deployment. ValueError for a
    share that is not a number."""
    replicas = list(_fractional_replicas(config))
    best: dict[int, tuple[float, tuple[_GpuReplica, ...]]] = {0: (0.0, ())}  # units of the GPU used -> top claim
    for replica in replicas:
        units = round(replica.num_gpus * _RESOURCE_UNITS)
        for used, (claim, chosen) in list(best.items()):
            total = used + units
            if total <= _RESOURCE_UNITS and claim + replica.claim > best.get(total, (-1.0, ()))[0]:
                best[total] = (claim + replica.claim, (*chosen, replica))
    claim, chosen = max(best.values(), key=lambda entry: entry[0])
    if claim <= 1.0 + 1e-9:
        return None
    counts: dict[tuple[str, float, float], int] = {}
    for replica in chosen:
        key = (replica.deployment, replica.num_gpus, replica.claim)
        counts[key] = counts.get(key, 0) + 1
    named = " + ".join(f"{count} x {name} (num_gpus {gpus:g}, share {share:g})"
                       for (name, gpus, share), count in counts.items())
    return (f"{named} fit one GPU by num_gpus but claim {claim:.2f} of it (memory fraction or "
            f"{MPS_PERCENTAGE_ENV} / 100 summed past 1): give each replica num_gpus equal to its share")


def _fractional_replicas(config: ServeDeploySchema) -> Iterator[_GpuReplica]:
    for app in config.applications:
        app_env = (app.runtime_env or {}).get("env_vars") or {}
        for deployment in app.deployments or []:
            fields = deployment.model_dump(exclude_unset=True)
            actor = fields.get("ray_actor_options") or {}
            num_gpus = float(actor.get("num_gpus") or 0.0)
            if not 0.0 < num_gpus < 1.0:
                continue  # no GPU, or whole GPUs of its own
            env = app_env | ((actor.get("runtime_env") or {}).get("env_vars") or {})
            name = f"{app.name}/{deployment.name}"
            replica = _GpuReplica(name, num_gpus, _claim(env, num_gpus, name))
            yield from [replica] * _max_replicas(fields)


def _claim(env: Mapping[str, Any], num_gpus: float, deployment: str) -> float:
    shares = []
    for name, scale in ((CUDA_MEMORY_FRACTION_ENV, 1.0), (MPS_PERCENTAGE_ENV, 0.01)):
        if name in env:
            try:
                shares.append(float(env[name]) * scale)
            except ValueError:
                raise ValueError(f"{deployment}: runtime_env.env_vars.{name} = {env[name]!r} is not a number") from None
    return max(shares, default=num_gpus)


def _max_replicas(fields: Mapping[str, Any]) -> int:
    replicas = fields.get("num_replicas", 1)
    if isinstance(replicas, int):
        return replicas
    autoscaling = fields.get("autoscaling_config") or {}  # "auto" or autoscaled: its most replicas
    return int(autoscaling.get("max_replicas", 100 if replicas == "auto" else 1))
