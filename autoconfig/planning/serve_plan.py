"""The Serve config and KubeRay worker groups that realise a plan of the DLRM app (``disagg.app:build_app``).

Pools and deployments: disaggregated ``DisaggregatedDLRM`` (dense side) and ``EmbeddingShard`` (``shards``
deployments ``EmbeddingShard_<i>``, each ``replicas_per_shard`` replicas); monolithic ``MonolithicDLRM``. Each
replica asks for its CPUs, GPUs and memory (``ray_actor_options``) and one unit of its pool's custom resource
(``dense_pool`` for the dense and monolithic replicas, ``embedding_pool`` for the shards, as in
``deploy/serve_config.gpu.yaml``); each node of the plan offers as many units as the plan put replicas of that pool
there, so Ray can place no more on it, and nodes that offer the same are one worker group. The knobs are written
with ``autoconfig.knobs`` (dotted paths) and the result is validated as ``autoconfig check`` validates a config.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from ray.serve.schema import ServeDeploySchema

from autoconfig.gpu_share import CUDA_MEMORY_FRACTION_ENV
from autoconfig.knobs import configure_serve_config
from autoconfig.planning.cluster import NodeShape
from autoconfig.planning.plan import Plan
from autoconfig.planning.services import Layout, Pool, Workload

DLRM_APP = "disagg.app:build_app"
#: Pools of each layout of the DLRM app and the custom resource each replica takes one unit of.
LAYOUT_POOLS: Mapping[str, Mapping[str, str]] = {
    "disaggregated": {"DisaggregatedDLRM": "dense_pool", "EmbeddingShard": "embedding_pool"},
    "monolithic": {"MonolithicDLRM": "dense_pool"},
}
SHARDED = "EmbeddingShard"
GIB = 2**30


class ServePlanError(ValueError):
    """A plan that no Serve config of the template can realise; the message names the service and pool."""


def app_pools(workload: Workload) -> dict[str, list[Pool]]:
    """The pools of the services that name a Serve application, by application."""
    pools: dict[str, list[Pool]] = defaultdict(list)
    for pool in workload.pools:
        if pool.app is not None:
            pools[pool.app].append(pool)
    return dict(pools)


def check_template(template: ServeDeploySchema, workload: Workload) -> None:
    """Refuse, before any placement, services whose application is not a DLRM app of the template or whose pools
    are not that layout's deployments."""
    apps = {app.name: app for app in template.applications}
    known = LAYOUT_POOLS[workload.layout]
    for name, pools in app_pools(workload).items():
        service = pools[0].service
        if name not in apps:
            raise ServePlanError(f"service {service!r}: the template has no application {name!r} (it has "
                                 f"{', '.join(apps)})")
        if apps[name].import_path != DLRM_APP:
            raise ServePlanError(f"service {service!r}: application {name!r} is {apps[name].import_path}; plans "
                                 f"are written for {DLRM_APP} only")
        for pool in pools:
            if pool.deployment not in known:
                raise ServePlanError(f"service {service!r}: pool {pool.deployment!r} is no {workload.layout} "
                                     f"deployment of the DLRM app ({', '.join(known)})")
            if (pool.shards is not None) != (pool.deployment == SHARDED):
                raise ServePlanError(f"service {service!r}: pool {pool.deployment!r}: shards is for {SHARDED} "
                                     "(its number of shards), and needed there")
        missing = [deployment for deployment in known if deployment not in {pool.deployment for pool in pools}]
        if missing:
            raise ServePlanError(f"service {service!r}: no pool {missing[0]!r} (a {workload.layout} DLRM app has "
                                 f"{', '.join(known)})")


def _deployments(app: dict[str, Any], layout: Layout, shards: int) -> list[dict[str, Any]]:
    """The app's deployment entries for ``layout``: the other layout's removed, one per shard."""
    entries = [dict(entry) for entry in app.get("deployments") or []]
    if layout == "monolithic":
        dropped = ("DisaggregatedDLRM", "ShardDirectory")
        entries = [e for e in entries if e["name"] not in dropped and not e["name"].startswith(f"{SHARDED}_")]
        names = ["MonolithicDLRM"]
    else:
        template = next((e for e in entries if e["name"].startswith(f"{SHARDED}_")), {})
        kept = {f"{SHARDED}_{i}" for i in range(shards)}
        entries = [e for e in entries if e["name"] != "MonolithicDLRM" and (
            e["name"] in kept or not e["name"].startswith(f"{SHARDED}_"))]
        names = ["DisaggregatedDLRM", *sorted(kept, key=lambda name: int(name.rsplit("_", 1)[1]))]
        for name in names[1:]:
            if all(e["name"] != name for e in entries):
                entries.append({**template, "name": name})
    for name in names:
        if all(e["name"] != name for e in entries):
            entries.append({"name": name})
    return entries


def _pool_knobs(pool: Pool, resource: str) -> dict[str, Any]:
    """Dotted-path knobs (``autoconfig.knobs``) that give each replica of ``pool`` its resources."""
    target = f"{SHARDED}_*" if pool.deployment == SHARDED else pool.deployment
    knobs: dict[str, Any] = {f"{target}.ray_actor_options.num_cpus": pool.cpus,
                             f"{target}.ray_actor_options.num_gpus": pool.gpus,
                             f"{target}.ray_actor_options.resources": {resource: 1}}
    if pool.memory_gib > 0:
        knobs[f"{target}.ray_actor_options.memory"] = int(pool.memory_gib * GIB)
    if pool.gpus > 0:
        knobs[f"{target}.ray_actor_options.runtime_env.env_vars.{CUDA_MEMORY_FRACTION_ENV}"] = str(min(pool.gpus, 1))
    if pool.deployment == SHARDED:
        knobs |= {"args.embedding.num_shards": pool.shards, "args.embedding.replicas_per_shard": pool.replicas}
    else:
        knobs[f"{target}.num_replicas"] = pool.replicas
    return knobs


def serve_config(template: ServeDeploySchema, plan: Plan) -> ServeDeploySchema:
    """``template`` with every planned DLRM app set to its pools (replicas, resources, layout), validated."""
    layout = plan.workload.layout
    config = template
    for name, pools in app_pools(plan.workload).items():
        shards = next((pool.shards or 0 for pool in pools if pool.deployment == SHARDED), 0)
        raw = config.model_dump(exclude_unset=True)
        app = next(app for app in raw["applications"] if app["name"] == name)
        app["deployments"] = _deployments(app, layout, shards)
        config = ServeDeploySchema.model_validate(raw)
        config = configure_serve_config(config, name, {"args.serving": layout})
        for pool in pools:  # on CPU num_cpus also writes the replica's enforced share
            config = configure_serve_config(config, name, _pool_knobs(pool, LAYOUT_POOLS[layout][pool.deployment]),
                                            accelerator="gpu" if pool.gpus > 0 else "cpu")
    return config


def node_offers(plan: Plan) -> dict[int, dict[str, int]]:
    """Custom resources each node of the plan offers: one unit per replica of an app pool placed there."""
    resources = {(pool.service, deployment): LAYOUT_POOLS[plan.workload.layout].get(pool.deployment)
                 for pool in plan.workload.pools if pool.app is not None for deployment in pool.deployments()}
    offers: dict[int, Counter[str]] = defaultdict(Counter)
    for instance, node in zip(plan.workload.instances, plan.placement.nodes, strict=True):
        resource = resources.get((instance.service, instance.pool))
        if node >= 0 and resource is not None:
            offers[int(node)][resource] += 1
    return {node: dict(sorted(counter.items())) for node, counter in sorted(offers.items())}


def _quantity(value: float, unit: str = "") -> str:
    return f"{value:g}{unit}" if float(value).is_integer() else f"{round(value * 1000)}m{unit}"


def worker_groups(plan: Plan, *, image: str = "swiftserve:latest") -> list[dict[str, Any]]:
    """KubeRay ``workerGroupSpecs`` for the plan's nodes that host app pools: one group per node shape and offer,
    one pod per node taking the whole node, ``rayStartParams.resources`` the offer."""
    groups: Counter[tuple[NodeShape, str]] = Counter()
    for node, offer in node_offers(plan).items():
        groups[(plan.cluster.shape(node), json.dumps(offer, sort_keys=True))] += 1
    specs = []
    for number, ((shape, offer), count) in enumerate(sorted(groups.items(), key=lambda item: item[0]), start=1):
        limits = {"cpu": _quantity(shape.cpus), "memory": f"{int(shape.memory_gib * 1024)}Mi"}
        pod: dict[str, Any] = {"containers": [{"name": "ray-worker", "image": image,
                                               "resources": {"requests": limits, "limits": dict(limits)}}]}
        if shape.gpus:
            for quantities in pod["containers"][0]["resources"].values():
                quantities["nvidia.com/gpu"] = str(shape.gpus)
            pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        kind = f"{shape.gpus}gpu" if shape.gpus else "cpu"
        specs.append({"groupName": f"plan-{number}-{kind}", "replicas": count, "minReplicas": count,
                      "maxReplicas": count, "rayStartParams": {"resources": json.dumps(json.dumps(json.loads(offer)))},
                      "template": {"spec": pod}})
    return specs


def write_worker_groups(specs: Sequence[dict[str, Any]], path: str | Path) -> None:
    """The worker groups as ``workerGroupSpecs:`` YAML, for a RayService's ``rayClusterConfig``."""
    Path(path).write_text(yaml.safe_dump({"workerGroupSpecs": list(specs)}, sort_keys=False))
