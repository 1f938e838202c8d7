"""Shared plumbing of the benchmark scripts: generated inputs, load generators and their outcomes (machine,
provenance and result files: ``benchmarks.records``)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import torch
from safetensors.torch import save_file

from serving.engine import GenerationParams
from serving.lora.format import LoRATargets

if TYPE_CHECKING:
    from autoconfig.workloads import RequestSource
    from serving.presets import DiffusionComponents

#: One replica on each of the two cores a benchmark's system gets (``DeviceMap`` entries).
CORES: list[list[int]] = [[0], [1]]


ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def write_attention_lora(path: Path, targets: LoRATargets, rank: int, seed: int = 0) -> int:
    """A PEFT-format fp16 LoRA of ``rank`` on every attention projection of the denoiser (a UNet's, or SD3's
    transformer's); returns its size in bytes."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    prefix = targets.denoiser_prefix
    for name, shape in targets.denoiser.items():
        if not name.endswith(ATTENTION_PROJECTIONS):
            continue
        tensors[f"{prefix}.{name}.lora_A.weight"] = (torch.randn(rank, shape.in_features, generator=generator)
                                                     / shape.in_features**0.5).half()
        tensors[f"{prefix}.{name}.lora_B.weight"] = (torch.randn(shape.out_features, rank, generator=generator)
                                                     * 0.01).half()
    save_file(tensors, str(path))
    return path.stat().st_size


def evict_from_page_cache(path: Path) -> None:
    """Drops ``path``'s pages from the OS page cache (flushed first), so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sharing_weights(components: DiffusionComponents) -> DiffusionComponents:
    """A second set of ``components`` over the same weight storage: module and parameter objects of its own (hooks,
    LoRA adapters, device and dtype moves on one leave the other as it was), so a second model costs no weight
    memory; an in-place write to a weight (diffusers' ``fuse_lora``) shows in both. Tokenizers are shared, the
    scheduler (which diffusers' pipelines set per call) is copied."""
    memo: dict[int, object] = {}
    modules = {name: module_sharing_weights(module, memo) for name, module in components.modules().items()}
    return dataclasses.replace(components, **modules, scheduler=copy.deepcopy(components.scheduler))


def module_sharing_weights(module: torch.nn.Module, memo: dict[int, object] | None = None) -> torch.nn.Module:
    """A copy of ``module`` over the same weight storage (parameters and buffers), as ``sharing_weights`` makes of
    each component; ``memo`` is shared across the modules of one model."""
    memo = {} if memo is None else memo
    for parameter in module.parameters():
        memo.setdefault(id(parameter), torch.nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad))
    for buffer in module.buffers():
        memo.setdefault(id(buffer), buffer)
    return copy.deepcopy(module, memo)


#: What ``ControlNetModel.from_unet`` copies from the UNet: the ControlNet's encoder.
_ENCODER_FROM_UNET = ("conv_in", "time_proj", "time_embedding", "class_embedding", "add_embedding", "down_blocks",
                      "mid_block")


def share_encoder_with_unet(controlnet: torch.nn.Module, unet: torch.nn.Module) -> int:
    """Points ``controlnet``'s encoder, a copy of ``unet``'s (an untrained ``from_unet`` ControlNet), at the UNet's
    weight storage through parameter objects of its own, as ``module_sharing_weights`` does; returns the bytes
    freed. ValueError where a weight differs from the UNet's: only an exact copy may be shared."""
    freed = 0
    for part_name in _ENCODER_FROM_UNET:
        part, source = getattr(controlnet, part_name, None), getattr(unet, part_name, None)
        if part is None or source is None:
            continue
        sources = dict(source.named_parameters())
        for name, parameter in list(part.named_parameters()):
            shared = sources.get(name)
            if shared is None or shared.shape != parameter.shape or not torch.equal(shared, parameter):
                raise ValueError(f"the ControlNet's {part_name}.{name} is not a copy of the UNet's")
            owner, _, leaf = name.rpartition(".")
            setattr(part.get_submodule(owner), leaf,
                    torch.nn.Parameter(shared.detach(), requires_grad=parameter.requires_grad))
            freed += parameter.numel() * parameter.element_size()
    return freed


def conditioning_image(size: int, index: int) -> np.ndarray:
    """A white rectangle on black, in one of two places by the parity of ``index``."""
    image = np.zeros((size, size, 3), np.uint8)
    quarter = size // 4
    image[quarter * (index % 2): quarter * (index % 2 + 2), quarter: quarter * 3] = 255
    return image


def diffusion_arguments(doc: str, *, steps: int, repeats: int,
                        options: Callable[[argparse.ArgumentParser], object] | None = None,
                        ) -> tuple[argparse.Namespace, GenerationParams]:
    """Command line shared by the diffusion benchmarks (``options`` adds a script's own), and the request every
    case starts from."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rank", type=int, default=64, help="rank of the LoRA files")
    parser.add_argument("--repeats", type=int, default=repeats)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    params = GenerationParams(prompt="a red circle on a white background", width=args.size, height=args.size,
                              num_inference_steps=args.steps, guidance_scale=7.5, seed=0)
    return args, params


def ranges_overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the [min, max] ranges of two sets of repeats overlap: a ratio of their medians is then a tie."""
    return min(a) <= max(b) and min(b) <= max(a)


def spread(repeats: Sequence[float]) -> dict[str, float | list[float]]:
    """Median, min and max of a figure's repeats, and the repeats."""
    return {"median": statistics.median(repeats), "min": min(repeats), "max": max(repeats), "repeats": list(repeats)}


def median_present(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None when none is)."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def tail(seconds: Sequence[float]) -> tuple[float | None, str]:
    """The p99, or the max where there are fewer than 100 samples (``BENCHMARKING.md``), and which it is."""
    if not len(seconds):
        return None, "max"
    if len(seconds) < 100:
        return float(max(seconds)), "max"
    return float(np.percentile(seconds, 99)), "p99"


# -- HTTP load: closed and open (Poisson) loops ------------------------------------------------------------------

#: Statuses recorded for requests that got no usable HTTP answer.
TRANSPORT_ERROR = -1  # the connection failed
TIMED_OUT = -2  # no answer within the client's timeout
UNEXPECTED_BODY = -3  # a 200 without what the request asked for (``expect``)
#: The statuses of a refusal: the server said it was overloaded.
REFUSALS = (429, 503)


@dataclass
class Outcomes:
    """Every answer of one load phase, in the order they came: which request (its index in the workload),
    status, seconds from scheduled send to answer, Retry-After, when it came (``time.monotonic``); open loop:
    seconds each request left after its scheduled time and when the first one was scheduled."""

    indices: list[int] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    retry_after: list[str | None] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)
    send_lag: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    #: per answer, the ``timings`` object of a 200's JSON body (the Images API's server-side seconds), else None
    server_timings: list[dict[str, float] | None] = field(default_factory=list)

    def add(self, index: int, status: int, seconds: float, retry_after: str | None,
            server_timings: dict[str, float] | None = None) -> None:
        self.indices.append(index)
        self.statuses.append(status)
        self.seconds.append(seconds)
        self.retry_after.append(retry_after)
        self.answered.append(time.monotonic())
        self.server_timings.append(server_timings)

    def counts(self) -> dict[str, int]:
        """Requests by outcome, each counted once: ``ok`` (200), ``refused`` (429/503), ``timed_out``, ``errors``
        (anything else)."""
        ok = self.statuses.count(200)
        refused = sum(self.statuses.count(status) for status in REFUSALS)
        timed_out = self.statuses.count(TIMED_OUT)
        return {"ok": ok, "refused": refused, "timed_out": timed_out,
                "errors": len(self.statuses) - ok - refused - timed_out}

    def ok_seconds(self) -> np.ndarray:
        return np.array([s for status, s in zip(self.statuses, self.seconds, strict=True) if status == 200])

    def wall_s(self) -> float:
        """Open loop: from the first scheduled send to the last answer."""
        assert self.first_scheduled is not None
        return max(self.answered) - self.first_scheduled

    def summary(self, duration_s: float) -> dict[str, float | int | None]:
        statuses, seconds = np.array(self.statuses), np.array(self.seconds)
        ok, refused = seconds[statuses == 200], seconds[statuses == 503]
        with_header = sum(1 for s, r in zip(self.statuses, self.retry_after, strict=True) if s == 503 and r)
        return {
            "sent": len(statuses), "ok": len(ok), "refused_503": len(refused),
            "other": int(np.sum((statuses != 200) & (statuses != 503))),
            "refused_with_retry_after": with_header, "ok_per_s": len(ok) / duration_s,
            "ok_p50_ms": _ms(ok, 50), "ok_p99_ms": _ms(ok, 99), "refused_p50_ms": _ms(refused, 50),
            "refused_p99_ms": _ms(refused, 99), "send_lag_p99_ms": _ms(np.array(self.send_lag), 99),
        }


def _ms(seconds: np.ndarray, percentile: float) -> float | None:
    return 1e3 * float(np.percentile(seconds, percentile)) if len(seconds) else None


async def _send(session: aiohttp.ClientSession, base_url: str, workload: RequestSource, index: int,
                scheduled: float, out: Outcomes, expect: bytes | None) -> None:
    request = workload.request(index)
    try:
        async with session.request(request.method, base_url + request.path, data=request.body,
                                   headers=dict(request.headers)) as response:
            body = await response.read()
            status = UNEXPECTED_BODY if response.status == 200 and expect and expect not in body else response.status
            out.add(index, status, time.monotonic() - scheduled, response.headers.get("retry-after"),
                    server_timings(body) if status == 200 else None)
    except asyncio.TimeoutError:
        out.add(index, TIMED_OUT, time.monotonic() - scheduled, None)
    except aiohttp.ClientError:
        out.add(index, TRANSPORT_ERROR, time.monotonic() - scheduled, None)


TIMINGS_KEY = b'"timings":'


def server_timings(body: bytes) -> dict[str, float] | None:
    """The flat ``timings`` object of an Images API answer, found without parsing its images; None without one."""
    start = body.find(TIMINGS_KEY)
    if start < 0:
        return None
    start += len(TIMINGS_KEY)
    end = body.find(b"}", start)
    try:
        timings = json.loads(body[start:end + 1])
    except ValueError:
        return None
    return timings if isinstance(timings, dict) else None


def _session(connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """The load generator's HTTP client. aiohttp, not httpx: on this machine httpx's pool costs so much CPU per
    request at hundreds of connections (191 vs 5,042 requests/s at 256 open, same server) that it, not the app,
    saturated first."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def closed_loop(base_url: str, workload: RequestSource, clients: int, duration_s: float, *,
                      timeout_s: float = 300.0, expect: bytes | None = None) -> Outcomes:
    """``clients`` callers, each sending its next request when the last is answered."""
    out, end = Outcomes(), time.monotonic() + duration_s
    async with _session(clients + 8, timeout_s) as session:

        async def caller(offset: int) -> None:
            index = offset
            while time.monotonic() < end:
                await _send(session, base_url, workload, index, time.monotonic(), out, expect)
                index += clients

        await asyncio.gather(*(caller(offset) for offset in range(clients)))
    return out


def poisson_offsets(rate: float, seed: int, *, duration_s: float | None = None,
                    count: int | None = None) -> np.ndarray:
    """Seconds from the start at which Poisson arrivals at ``rate``/s come: the first ``count`` of them, or every
    one within ``duration_s``."""
    rng = np.random.default_rng(seed)
    if count is not None:
        return np.cumsum(rng.exponential(1.0 / rate, size=count))
    assert duration_s is not None
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.5) + 1))
    return offsets[offsets < duration_s]


async def open_loop(base_url: str, workload: RequestSource, offsets: Sequence[float], *, on_tick=None,
                    timeout_s: float = 300.0, expect: bytes | None = None) -> Outcomes:
    """Request ``i`` (``workload.request(i)``, its path under ``base_url``) sent ``offsets[i]`` seconds after the
    start, whatever the answers; ``on_tick()`` runs every second. A 200 whose body lacks ``expect`` is recorded as
    ``UNEXPECTED_BODY``.

    Latency counts from each request's scheduled time, so a client that falls behind its schedule shows it as
    latency; how late each request left is kept too (``Outcomes.send_lag``): a late client is not an overloaded app.
    """
    out = Outcomes()
    async with _session(1024, timeout_s) as session:
        start, tasks, next_tick = time.monotonic(), [], 0.0
        out.first_scheduled = start + (float(offsets[0]) if len(offsets) else 0.0)
        for index, offset in enumerate(offsets):
            while (now := time.monotonic() - start) < offset:
                if on_tick is not None and now >= next_tick:
                    on_tick()
                    next_tick = now + 1.0
                await asyncio.sleep(min(offset - now, 0.05))
            out.send_lag.append(now - offset)
            tasks.append(asyncio.create_task(_send(session, base_url, workload, index, start + offset, out, expect)))
        await asyncio.gather(*tasks)
    return out


def to_core_1() -> None:
    """Moves the calling thread to core 1 with the process's torch thread count: OpenMP sizes a new thread's team
    from its own default (every core), not from ``torch.set_num_threads`` in the main thread, and MKL's products
    read it (a team of two on one pinned core slows them)."""
    os.sched_setaffinity(0, {1})  # this thread only
    torch.set_num_threads(torch.get_num_threads())


def serve_config_app(name: str, import_path: str, args: dict[str, Any], replicas: dict[str, int] | None = None,
                     runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """One application of a Serve config at ``/``: ``replicas`` per named deployment, each replica taking a
    hundredth of a Ray CPU (pinning, not Ray, decides where it runs); ``runtime_env``: the application's."""
    options = {"ray_actor_options": {"num_cpus": 0.01}}
    app: dict[str, Any] = {"name": name, "route_prefix": "/", "import_path": import_path, "args": args}
    if runtime_env is not None:
        app["runtime_env"] = runtime_env
    if replicas:
        app["deployments"] = [{"name": deployment, "num_replicas": count, **options}
                              for deployment, count in replicas.items()]
    return app


def deploy_app(app: dict[str, object], port: int) -> None:
    """Replaces whatever Serve runs with ``app`` (one application of a Serve config), its HTTP proxy on ``port``
    of 127.0.0.1; waits until it runs."""
    from ray.serve.schema import ServeDeploySchema

    from autoconfig.serve_config import deploy_serve_config

    deploy_serve_config(ServeDeploySchema.model_validate({"http_options": {"host": "127.0.0.1", "port": port},
                                                          "applications": [app]}), timeout_s=1800)
