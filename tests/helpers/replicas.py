"""Reaching every replica of a Serve deployment through its handle (requests spread over the replicas), and
killing one."""

from collections.abc import Callable, Hashable
from typing import Any

import ray
from ray import serve
from ray.serve.context import _get_global_client


def answers_from_replicas(app: str, deployment: str, method: str, replicas: int,
                          key: Callable[[Any], Hashable] = lambda answer: answer) -> dict[Hashable, Any]:
    """``method``'s answers by ``key`` (e.g. the replica's pid), calling until ``replicas`` distinct keys came."""
    handle = serve.get_deployment_handle(deployment, app_name=app)
    answers: dict[Hashable, Any] = {}
    for _ in range(200):
        answer = getattr(handle, method).remote().result(timeout_s=60)
        answers[key(answer)] = answer
        if len(answers) == replicas:
            return answers
    raise AssertionError(f"saw {len(answers)} of {replicas} distinct answers from {deployment}.{method}")


def named_replicas(app: str, deployment: str) -> list[dict]:
    """The named actors of ``deployment``'s replicas in ``app`` (Serve names them ``...app#deployment#id``)."""
    return [actor for actor in ray.util.list_named_actors(all_namespaces=True)
            if f"{app}#{deployment}#" in actor["name"]]


def running_replicas(app: str, deployment: str) -> list[dict]:
    """Like ``named_replicas``, but only replicas Serve reports RUNNING (not a killed one not yet cleaned up)."""
    details = _get_global_client().get_serve_details()["applications"][app]["deployments"][deployment]
    return [{"name": replica["actor_name"], "namespace": "serve"}
            for replica in details["replicas"] if replica["state"] == "RUNNING"]


def kill_replica(replica: dict) -> None:
    """Kills one replica (an entry of ``named_replicas``) for good; Serve starts a replacement."""
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)


def ongoing_requests(replica: dict) -> int:
    """The requests ``replica`` holds now, running or queued in it (Serve's own count, which its routers poll;
    answered on a thread of its own, so a busy replica answers at once)."""
    actor = ray.get_actor(replica["name"], namespace=replica["namespace"])
    return ray.get(actor.get_num_ongoing_requests.remote(), timeout=30)
