"""What a process holds in memory: its RSS and the weight bytes of each model object alive in it.

Used by deployments to answer "which weights live where" (e.g. that base replicas hold no ControlNet),
and by benchmarks and soak tests to follow every Serve process's memory and file descriptors.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import types
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
import torch


@dataclass(frozen=True)
class ProcessMemory:
    """Process ``pid``'s resident bytes (``rss_bytes``), those no other process shares (``uss_bytes``: what one
    more such process costs), and, per model class name, the bytes of its weights and buffers."""

    pid: int
    rss_bytes: int
    uss_bytes: int
    model_bytes: dict[str, int] = field(default_factory=dict)


def _is_model(obj: object) -> bool:
    """Diffusers ``ModelMixin`` and transformers ``PreTrainedModel`` instances."""
    cls = type(obj)
    return issubclass(cls, torch.nn.Module) and any(
        base.__name__ in ("ModelMixin", "PreTrainedModel") for base in cls.__mro__
    )


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType,
           torch.Tensor, str, bytes)


def _models_reachable_from(roots: Iterable[object]) -> list[torch.nn.Module]:
    """Models reachable from ``roots`` through containers and object attributes, outermost only (a ControlNet,
    not its blocks). A walk, not ``gc.get_objects()``: Serve freezes a replica's heap after start-up, which
    hides its objects from the latter."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if _is_model(obj):
            found[id(obj)] = obj
            continue
        stack.extend(gc.get_referents(obj))
    return list(found.values())


def process_memory(*roots: object) -> ProcessMemory:
    """This process's RSS and the tensor bytes of the models reachable from ``roots``, each storage counted once."""
    seen: set[int] = set()
    model_bytes: Counter[str] = Counter()
    for model in _models_reachable_from(roots):
        for tensor in (*model.parameters(), *model.buffers()):
            storage = tensor.untyped_storage()
            if tensor.device.type == "meta" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            model_bytes[type(model).__name__] += storage.nbytes()
    memory = psutil.Process().memory_full_info()
    return ProcessMemory(pid=os.getpid(), rss_bytes=memory.rss, uss_bytes=memory.uss, model_bytes=dict(model_bytes))


class MemoryReport:
    """Deployment mixin: ``memory_report()`` answers the replica's ``ProcessMemory`` (models reachable from it)."""

    async def memory_report(self) -> ProcessMemory:
        return await asyncio.to_thread(process_memory, self)


#: Ray titles a Serve process ``ray::ServeReplica:<app>:<deployment>[.<method>]``, ``ray::ProxyActor``, ...
_SERVE_PROCESS = re.compile(r"ray::(ServeReplica:[\w-]+:[\w-]+|ProxyActor|ServeController)")


def serve_processes() -> dict[str, psutil.Process]:
    """Every Serve process on this machine (replicas, proxy, controller), as ``<title>#<pid>``."""
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        match = _SERVE_PROCESS.match(" ".join(process.info["cmdline"] or []))
        if match:
            found[f"{match.group(1)}#{process.pid}"] = process
    return found
