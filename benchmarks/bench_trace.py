"""Goodput on a production trace: GenTD26 replayed through swiftserve's Serve app and through diffusers in Serve.

The workload (``benchmarks.gentd``): the busiest ``--hours`` of GenTD26 (or ``--window START END``), arrivals
compressed ``--compression`` times, each traced base model mapped onto one of ``--models`` served models (the top
ones by requests get one each, the rest are dealt over them by rank), ``num_lora`` LoRAs drawn per request from a
seeded Zipf (``--zipf``) over a pool of ``--loras-per-model`` per served model, ``predict_type`` sent as text-to-image
(``/v1/images/generations``), image-to-image or inpainting (``/v1/images/edits`` with a seeded image, and a mask
for inpainting), ``num_images_per_prompt`` as ``n``, steps times ``--step-scale``. LoRA files come from emulated
remote storage (``benchmarks.lora_storage``): each fetch waits a load latency drawn from the trace's LoRA load
times, divided by the same compression. The served models are ``--preset`` with seeded weights, one seed each.

Three systems, each a Serve app on a 2-CPU Ray cluster behind the same ``ImagesIngress``, on cores 0 and 1 (one
torch thread each), deployed one at a time:

- ``production``: diffusers as the traced service ran it (``benchmarks.vanilla``): a replica per served model per
  core, a pipeline per replica, one request at a time, each request's LoRAs fetched, loaded and fused before it,
  unfused and unloaded after it;
- ``strongest``: the same with every LoRA kept loaded as a PEFT adapter from its first use and picked per request
  with ``set_adapters``, and each model's queue bounded (Serve's ``max_queued_requests``: ``--strongest-queue``
  requests wait for a replica of the model; past them a request is refused at once, as ours refuses what would
  wait too long);
- ``ours``: ``serving.app:build_multi_app`` (step-level batching, host LoRA cache with asynchronous loads,
  admission control), pinned by ``device_map``: by default (``--ours-layout shared``) one ``DiffusionModelGroup``
  replica per core serving every model, their engine loops taking turns at the core (``shared_replicas``); or a
  replica per model per core as the baselines (``per-core``), or one per model dealt onto the cores (``by-load``).

Per run, after deploying and warming every model: each request shape (kind, n, steps) present in the window sent
alone ``--calibration-sends`` times (after one untimed send) to measure its unloaded latency on that system; then
the window replayed open-loop. A request is good when it got a 200 with its images within ``--slo-factor`` times
its shape's unloaded latency on the system that served it (latency from its scheduled send); refusals, errors and
timeouts are never good. Goodput = good requests per minute of the (compressed) window. Runs are interleaved
(``production, strongest, ours`` per repeat). Results: ``<--out>/bench_trace.{json,md}``.

``--in-process`` drives the same systems without Ray (where Ray cannot run: a GPU machine without its wheel): the
same Images API on uvicorn in this process, over one engine loop per model (ours) or one diffusers baseline per
model serving one request at a time, every model on one device; the results say so.

    .venv/bin/python -m benchmarks.bench_trace --trace ../shared/traces/gentd26_lora_request_trace.csv \\
        --load-latencies ../shared/traces/gentd26_lora_update_latency_anon.csv [--hours 1] [--compression 100]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from PIL import Image
from ray import serve

from autoconfig.workloads import JSON_HEADERS, HttpRequest
from benchmarks import gentd, lora_storage
from benchmarks.common import (
    CORES,
    Outcomes,
    deploy_app,
    median_present,
    open_loop,
    ranges_overlap,
    serve_config_app,
    spread,
    tail,
    write_attention_lora,
)
from benchmarks.lora_storage import EmulatedStorage
from benchmarks.records import RESULTS, machine, provenance, write_results
from serving.api.edits import EDITS_PATH
from serving.api.models import ServedModel, ServedModels
from serving.api.server import create_images_api
from serving.common.allocator import TUNED_MALLOC_ENV
from serving.common.device import DTYPES
from serving.common.net import free_port
from serving.config import (
    DeviceMap,
    DiffusionAppConfig,
    DiffusionModelConfig,
    EngineConfig,
    ImageLimits,
    LoRAConfig,
)
from serving.engine import LocalBackend, load_components
from serving.engine.shared_core import SharedCore
from serving.lora.format import LoRATargets
from serving.preset_catalog import PRESET_NAMES

NAME = "bench_trace"
SYSTEMS = ("production", "strongest", "ours")
GENERATIONS_PATH = "/v1/images/generations"
IMAGE = b'"b64_json"'
GUIDANCE_SCALE = 7.5
CALIBRATION_PROMPT = "a red circle on a white background"


# -- requests ----------------------------------------------------------------------------------------------------

def edit_image(size: int, seed: int) -> bytes:
    """A seeded RGB PNG of ``size`` x ``size``: what an edit starts from."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return _png(Image.fromarray(pixels))


def inpaint_mask(size: int) -> bytes:
    """A PNG mask repainting the central half of the image (white: repaint)."""
    mask = np.zeros((size, size), np.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return _png(Image.fromarray(mask))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def multipart(fields: dict[str, str], files: dict[str, bytes], boundary: str) -> tuple[bytes, str]:
    """``fields`` and PNG ``files`` as a multipart/form-data body and its content type."""
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, data in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.png"\r\n'
                     f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def http_request(request: gentd.ReplayedRequest, size: int) -> HttpRequest:
    """The Images API request ``request`` is: a JSON generation, or a multipart edit (a mask for inpainting)."""
    fields: dict[str, Any] = {"prompt": request.prompt, "model": request.model, "n": request.n,
                              "size": f"{size}x{size}", "num_inference_steps": request.steps,
                              "guidance_scale": GUIDANCE_SCALE, "seed": request.seed}
    if request.negative_prompt:
        fields["negative_prompt"] = request.negative_prompt
    loras = [{"name": name, "scale": 0.8} for name in request.loras]
    if request.kind == "generate":
        return HttpRequest("POST", GENERATIONS_PATH, json.dumps(fields | {"loras": loras}).encode(), JSON_HEADERS)
    files = {"image": edit_image(size, request.seed)}
    if request.kind == "inpaint":
        files["mask"] = inpaint_mask(size)
    form = {key: str(value) for key, value in fields.items()} | {"loras": json.dumps(loras)}
    body, content_type = multipart(form, files, boundary=f"swiftserve-trace-{request.seed}")
    return HttpRequest("POST", EDITS_PATH, body, {"content-type": content_type})


@dataclass(frozen=True)
class Requests:
    """A fixed list of requests, request ``i`` sent ``i``-th (``benchmarks.common.open_loop``'s source)."""

    items: Sequence[HttpRequest]

    def request(self, index: int) -> HttpRequest:
        return self.items[index]


def shape_request(shape: tuple[str, int, int], model: str, seed: int) -> gentd.ReplayedRequest:
    """A request of ``shape`` (kind, n, steps) on ``model`` with no LoRA: what an unloaded latency is measured on."""
    kind, n, steps = shape
    return gentd.ReplayedRequest(0.0, kind, model, n, steps, (), CALIBRATION_PROMPT, None, seed, 0)


def shape_of(request: gentd.ReplayedRequest) -> tuple[str, int, int]:
    """What a request's unloaded latency depends on: every served model is the same preset (another seed)."""
    return request.kind, request.n, request.steps


# -- systems -----------------------------------------------------------------------------------------------------

def cores_by_load(replayed: list[gentd.ReplayedRequest], models: int) -> list[list[list[int]]]:
    """Each served model's ``device_map.model`` for one replica per model: models dealt onto ``CORES`` by their
    requests in the replay, the busiest first, each onto the core with the fewest so far."""
    load = Counter(request.model for request in replayed)
    placed: list[list[list[int]]] = [[] for _ in range(models)]
    totals = [0] * len(CORES)
    for k in sorted(range(models), key=lambda k: -load[f"m{k}"]):
        core = totals.index(min(totals))
        placed[k] = [CORES[core]]
        totals[core] += load[f"m{k}"]
    return placed


def model_configs(args: argparse.Namespace, lora_root: Path, replayed: list[gentd.ReplayedRequest],
                  ) -> list[DiffusionAppConfig]:
    """One config per served model: the preset with seed ``k``, its own LoRA directory, limits that admit every
    replayed request, ours' replicas on cores 0 and 1 (``--ours-layout``: one per core, shared or per model, or one
    per model placed by load)."""
    cores = (cores_by_load(replayed, args.models) if args.ours_layout == "by-load"
             else [CORES] * args.models)
    limits = ImageLimits(max_n=max(r.n for r in replayed), max_loras=max(len(r.loras) for r in replayed),
                         max_prompt_chars=args.max_prompt_chars)
    return [DiffusionAppConfig(
        model=DiffusionModelConfig(name=f"m{k}", preset=args.preset, weights="seeded", seed=k, device=args.device,
                                   dtype=args.dtype),
        limits=limits,
        engine=EngineConfig(admission_wait_fraction=args.admission_wait_fraction,
                            admission_max_slowdown=args.admission_max_slowdown, max_batch_rows=args.max_batch_rows),
        lora=LoRAConfig(directory=lora_root / f"m{k}"),
        device_map=DeviceMap(model=cores[k]),
    ) for k in range(args.models)]


def serve_app(system: str, configs: list[DiffusionAppConfig], strongest_queue: int = -1,
              shared: bool = False) -> dict[str, Any]:
    """The Serve config application of ``system``, at ``/``; every replica takes a hundredth of a Ray CPU (pinning,
    not Ray, decides where it runs). ``strongest_queue``: queued requests per model of ``strongest`` (-1: no
    bound). ``shared``: ours' models in one ``DiffusionModelGroup`` (``shared_replicas``)."""
    models = [config.model_dump(mode="json", exclude_defaults=True) for config in configs]
    if system == "ours" and shared:
        return serve_config_app(system, "serving.app:build_multi_app", {"models": models, "shared_replicas": True},
                                {"DiffusionModelGroup": len(configs[0].device_map.model)})
    if system == "ours":
        return serve_config_app(system, "serving.app:build_multi_app", {"models": models},
                                {f"DiffusionModel_{config.model.name}": len(config.device_map.model)
                                 for config in configs})
    return serve_config_app(system, "benchmarks.vanilla:build_vanilla_app",
                            {"models": models, "cores": CORES, "adapters": system == "strongest",
                             "max_queued_requests": queue_bound(system, strongest_queue)})


def queue_bound(system: str, strongest_queue: int) -> int:
    """A baseline model's ``max_queued_requests``: ``strongest_queue`` for ``strongest``, else -1 (unbounded, as
    Serve's default)."""
    return strongest_queue if system == "strongest" else -1


@contextmanager
def in_process(system: str, configs: list[DiffusionAppConfig], port: int, strongest_queue: int = -1,
               shared: bool = False) -> Iterator[None]:
    """``system`` without Ray: the same Images API (``create_images_api``) on uvicorn in a thread of this process,
    over one engine loop per model (ours) or one serialised ``DiffusersBaseline`` per model (one request at a
    time, as a Serve replica of it), every model on the configs' device."""
    import uvicorn

    from benchmarks.vanilla import DiffusersBaseline, SerialBackend

    if system == "ours":
        core = SharedCore() if shared else None
        backends = [LocalBackend.from_config(config, core=core) for config in configs]
    else:
        bound = queue_bound(system, strongest_queue)
        backends = [SerialBackend(DiffusersBaseline(config, [], adapters=system == "strongest"),
                                  max_queued=None if bound < 0 else bound)
                    for config in configs]
    api = create_images_api(ServedModels([ServedModel(backend, config)
                                          for backend, config in zip(backends, configs, strict=True)]))
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{system}", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the in-process {system} server did not start")
            time.sleep(0.05)
        yield
    finally:
        server.should_exit = True
        thread.join()
        for backend in backends:
            if isinstance(backend, LocalBackend):
                backend.close()


@contextmanager
def serving(system: str, configs: list[DiffusionAppConfig], port: int, args: argparse.Namespace) -> Iterator[None]:
    """``system`` answering on ``port`` for the block: deployed on Serve, or in-process with ``--in-process``."""
    if args.in_process:
        with in_process(system, configs, port, args.strongest_queue, args.ours_layout == "shared"):
            yield
    else:
        deploy_app(serve_app(system, configs, args.strongest_queue, args.ours_layout == "shared"), port)
        yield


@contextmanager
def lora_storage_installed(storage: EmulatedStorage, directory: Path, args: argparse.Namespace) -> Iterator[None]:
    """The emulated LoRA storage in every process that reads LoRAs: a local Ray cluster's workers (its job's
    runtime environment), or this process (``--in-process``)."""
    environment = storage.runtime_env(directory)
    if args.in_process:
        os.environ.update(environment["env_vars"])
        lora_storage.install()
        yield
        return
    environment["env_vars"] = environment["env_vars"] | TUNED_MALLOC_ENV  # every system's replicas, as ours' have it
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=2**30, runtime_env=environment)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


# -- measuring ---------------------------------------------------------------------------------------------------

def send(url: str, requests: list[HttpRequest], offsets: Sequence[float], timeout_s: float) -> Outcomes:
    return asyncio.run(open_loop(url, Requests(requests), offsets, timeout_s=timeout_s, expect=IMAGE))


def warm_up(url: str, args: argparse.Namespace, shapes: list[tuple[str, int, int]]) -> None:
    """Every model and kind (one image, the fewest steps of ``shapes``), one kind at a time, two requests per model
    at once (so both replicas of a model see one, and a bounded queue has room), twice. A refused one (a replica
    still settling can refuse the second) is sent again alone; anything else failing, or a refusal alone, raises."""
    steps = min(steps for _, _, steps in shapes)
    for _ in range(2):
        for kind in sorted({kind for kind, _, _ in shapes}):
            requests = [http_request(shape_request((kind, 1, steps), f"m{k}", seed), args.size)
                        for k in range(args.models) for seed in range(2)]
            out = send(url, requests, [0.0] * len(requests), args.timeout_s)
            statuses = Counter(out.statuses)
            if statuses[200] + statuses[503] != len(requests):
                raise RuntimeError(f"warm-up of {kind} failed: statuses {statuses}")
            for index, status in zip(out.indices, out.statuses, strict=True):
                if status == 503 and send(url, [requests[index]], [0.0], args.timeout_s).statuses != [200]:
                    raise RuntimeError(f"warm-up of {kind} refused a request sent alone")


def unloaded_latencies(url: str, args: argparse.Namespace, shapes: list[tuple[str, int, int]],
                       ) -> dict[tuple[str, int, int], float]:
    """Median latency of each shape sent alone (after one untimed send). A system failing one is broken: raises."""
    medians = {}
    for shape in shapes:
        request = http_request(shape_request(shape, "m0", seed=0), args.size)
        seconds = []
        for attempt in range(args.calibration_sends + 1):
            out = send(url, [request], [0.0], args.timeout_s)
            if out.statuses != [200]:
                raise RuntimeError(f"a {shape} request sent alone got status {out.statuses[0]}")
            if attempt:
                seconds += out.seconds
        medians[shape] = statistics.median(seconds)
    return medians


def judge(out: Outcomes, replayed: list[gentd.ReplayedRequest], unloaded: dict[tuple[str, int, int], float],
          slo_factor: float) -> list[bool]:
    """Per request (by index): answered 200 within ``slo_factor`` x its shape's unloaded latency."""
    good = [False] * len(replayed)
    for index, status, seconds in zip(out.indices, out.statuses, out.seconds, strict=True):
        good[index] = status == 200 and seconds <= slo_factor * unloaded[shape_of(replayed[index])]
    return good


def run_row(system: str, repeat: int, out: Outcomes, good: list[bool], replayed: list[gentd.ReplayedRequest],
            window_s: float) -> dict:
    """One run's figures: outcomes, goodput, SLO attainment (all and by kind), latency of the successes (from
    fewer than 100 successes the p99 is their maximum, and ``tail`` says so)."""
    ok, counts = out.ok_seconds(), out.counts()
    p99_s, tail_kind = tail(ok)
    kinds = sorted({request.kind for request in replayed})
    return {
        "system": system, "repeat": repeat, "sent": len(replayed), **counts, "good": sum(good),
        "goodput_per_min": 60 * sum(good) / window_s, "slo_attainment": sum(good) / len(replayed),
        "slo_attainment_by_kind": {kind: statistics.fmean(g for g, r in zip(good, replayed, strict=True)
                                                          if r.kind == kind) for kind in kinds},
        "slo_attainment_with_loras": _share([g for g, r in zip(good, replayed, strict=True) if r.loras]),
        "p50_s": float(np.median(ok)) if len(ok) else None,
        "p99_s": p99_s, "tail": tail_kind,
        "wall_s": out.wall_s(), "send_lag_p99_ms": 1e3 * float(np.percentile(out.send_lag, 99)),
        "time_split": time_split(out, good),
    }


def time_split(out: Outcomes, good: list[bool]) -> dict[str, dict]:
    """Where the answered requests' time went, good and late apart: how many, and the medians of their latency,
    of each server-side timing the answers carry (``total_s`` in the API handler; ours also ``queue_s`` before the
    first step, ``denoise_s``, ``decode_s``) and of ``outside_s`` (latency less ``total_s``: proxy, HTTP, client)."""
    split: dict[str, dict] = {}
    for label, wanted in (("good", True), ("late", False)):
        answers = [(seconds, timings or {}) for index, status, seconds, timings
                   in zip(out.indices, out.statuses, out.seconds, out.server_timings, strict=True)
                   if status == 200 and good[index] is wanted]
        figures: dict[str, float | int | None] = {"count": len(answers)}
        if answers:
            figures["latency_s"] = statistics.median(seconds for seconds, _ in answers)
            for key in sorted({key for _, timings in answers for key in timings}):
                figures[key] = statistics.median(timings[key] for _, timings in answers if key in timings)
            outside = [seconds - timings["total_s"] for seconds, timings in answers if "total_s" in timings]
            figures["outside_s"] = statistics.median(outside) if outside else None
        split[label] = figures
    return split


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def aggregate(rows: list[dict]) -> dict:
    """Per system: goodput median/min/max and every repeat, attainment and latency medians, outcome totals."""
    figures = {}
    for name in SYSTEMS:
        mine = [row for row in rows if row["system"] == name]
        if not mine:
            continue
        goodput = [row["goodput_per_min"] for row in mine]
        figures[name] = {
            "goodput_per_min": spread(goodput),
            **{key: median_present([row[key] for row in mine]) for key in ("slo_attainment", "p50_s", "p99_s")},
            "tail": "p99" if all(row["tail"] == "p99" for row in mine) else "max",
            **{key: sum(row[key] for row in mine) for key in ("sent", "ok", "good", "refused", "errors",
                                                              "timed_out")},
        }
    return figures


#: Summary key -> the system ours' goodput is divided by.
RATIOS = {"goodput_ratio_vs_production": "production", "goodput_ratio_vs_strongest": "strongest"}


def summarize(figures: dict) -> tuple[dict, dict]:
    """The issue's summary (goodput ratios of medians, ours' SLO attainment, every system's p50 and p99) and which
    ratios are ties (goodput ranges overlap)."""
    summary, ties = {}, {}
    ours = figures.get("ours")
    for key, other in RATIOS.items():
        if ours is None or other not in figures:
            continue
        a, b = ours["goodput_per_min"], figures[other]["goodput_per_min"]
        summary[key] = a["median"] / b["median"] if b["median"] else None
        ties[key] = ranges_overlap(a["repeats"], b["repeats"])
    if ours is not None:
        summary["slo_attainment"] = ours["slo_attainment"]
    for name, figure in figures.items():
        summary[f"p50_s_{name}"] = figure["p50_s"]
        summary[f"p99_s_{name}"] = figure["p99_s"]
    return summary, ties


# -- main --------------------------------------------------------------------------------------------------------

def _arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=gentd.REQUESTS, help="GenTD26 request trace (CSV)")
    parser.add_argument("--load-latencies", type=Path, default=gentd.LOAD_LATENCIES,
                        help="GenTD26 LoRA load latencies (CSV)")
    parser.add_argument("--hours", type=float, default=1.0, help="length of the busiest window replayed")
    parser.add_argument("--window", nargs=2, metavar=("START", "END"), default=None,
                        help="replay [START, END) instead, e.g. '2024-12-05 23:00:00' '2024-12-06 00:00:00'")
    parser.add_argument("--max-requests", type=int, default=None, help="replay only the window's first N")
    parser.add_argument("--compression", type=float, default=100.0,
                        help="trace seconds per replayed second (arrivals and LoRA fetch times)")
    parser.add_argument("--step-scale", type=float, default=0.1, help="replayed steps per traced step")
    parser.add_argument("--models", type=int, default=4, help="served base models")
    parser.add_argument("--loras-per-model", type=int, default=8, help="LoRA files per served model")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the LoRA draw")
    parser.add_argument("--rank", type=int, default=8, help="rank of the LoRA files")
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--max-prompt-chars", type=int, default=ImageLimits().max_prompt_chars)
    parser.add_argument("--slo-factor", type=float, default=5.0, help="SLO: this many times the unloaded latency")
    parser.add_argument("--calibration-sends", type=int, default=3, help="timed sends per shape, alone")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every system")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--in-process", action="store_true",
                        help="no Ray: every system in this process behind the same Images API (where Ray cannot "
                             "run, e.g. a GPU machine without its wheel); the results say so")
    parser.add_argument("--admission-wait-fraction", type=lambda text: None if text == "none" else float(text),
                        default=EngineConfig().admission_wait_fraction,
                        help="ours' engine.admission_wait_fraction ('none': no admission control)")
    parser.add_argument("--admission-max-slowdown", type=lambda text: None if text == "none" else float(text),
                        default=EngineConfig().admission_max_slowdown,
                        help="ours' engine.admission_max_slowdown ('none': off)")
    parser.add_argument("--ours-layout", choices=("shared", "per-core", "by-load"), default="shared",
                        help="ours' model replicas: one per core serving every model (shared_replicas), one per "
                             "model on each core (as the baselines), or one per model, the models dealt onto the "
                             "cores by their requests")
    parser.add_argument("--max-batch-rows", type=int, default=EngineConfig().max_batch_rows,
                        help="ours' engine.max_batch_rows")
    parser.add_argument("--strongest-queue", type=int, default=2,
                        help="requests that wait for a replica of a strongest model before it refuses (-1: no bound)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="client timeout of one request")
    parser.add_argument("--device", default="auto", help="torch device of every model")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    args = parser.parse_args(argv)
    for name in ("compression", "step_scale", "slo_factor", "hours"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("models", "loras_per_model", "calibration_sends", "repeats", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


@dataclass(frozen=True)
class Workload:
    """The replayed window and where it came from."""

    start: float
    end: float
    traced: int
    models: dict[str, str]
    replayed: list[gentd.ReplayedRequest]


def workload(args: argparse.Namespace) -> Workload:
    requests = gentd.read_requests(args.trace)
    start, end = ((gentd.parse_time(args.window[0]), gentd.parse_time(args.window[1])) if args.window
                  else gentd.busiest_window(requests, args.hours))
    window = gentd.in_window(requests, start, end)
    if not window:
        raise SystemExit(f"no traced request in the window [{args.window[0]}, {args.window[1]})")
    models = gentd.served_model_names(window, args.models)
    replayed = gentd.replay(window, start, compression=args.compression, step_scale=args.step_scale, models=models,
                            loras_per_model=args.loras_per_model, zipf_exponent=args.zipf,
                            max_prompt_chars=args.max_prompt_chars, seed=args.seed)
    return Workload(start, end, len(window), models, replayed[:args.max_requests])


def main(argv: Sequence[str] | None = None) -> dict:
    args = _arguments(argv)
    began = time.monotonic()
    trace = workload(args)
    replayed = trace.replayed
    storage = EmulatedStorage(gentd.read_load_latencies_ms(args.load_latencies), args.compression, args.seed)
    window_s = (trace.end - trace.start) / args.compression
    if args.max_requests is not None:
        window_s = max(r.offset_s for r in replayed) if len(replayed) > 1 else window_s
    shapes = sorted({shape_of(request) for request in replayed})
    requests = [http_request(request, args.size) for request in replayed]
    offsets = [request.offset_s for request in replayed]
    print(f"{len(replayed)} requests over {window_s:.1f} s ({trace.traced} traced), {len(shapes)} shapes",
          flush=True)
    rows, calibration = [], []
    with tempfile.TemporaryDirectory() as tmp:
        lora_root = Path(tmp)
        lora_bytes = write_loras(args, lora_root)
        configs = model_configs(args, lora_root, replayed)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with lora_storage_installed(storage, lora_root, args):
            for repeat in range(args.repeats):
                for system in args.systems:
                    phase = time.monotonic()
                    with serving(system, configs, port, args):
                        deployed = time.monotonic()
                        warm_up(url, args, shapes)
                        unloaded = unloaded_latencies(url, args, shapes)
                        calibrated = time.monotonic()
                        out = send(url, requests, offsets, args.timeout_s)
                    good = judge(out, replayed, unloaded, args.slo_factor)
                    row = run_row(system, repeat, out, good, replayed, window_s)
                    row["phase_s"] = {"deploy": deployed - phase, "warm_up_and_calibration": calibrated - deployed,
                                      "run": row["wall_s"]}
                    rows.append(row)
                    calibration.append({"system": system, "repeat": repeat,
                                        "unloaded_s": {"/".join(map(str, shape)): seconds
                                                       for shape, seconds in unloaded.items()}})
                    print(json.dumps(row), flush=True)
    figures = aggregate(rows)
    summary, ties = summarize(figures)
    payload = {
        **provenance(), "machine": machine(), "args": {**vars(args), **{k: str(v) for k, v in vars(args).items()
                                                                        if isinstance(v, Path)}},
        "device_map": ("in one process (--in-process): one engine or pipeline per served model on the model device"
                       if args.in_process else
                       {"production, strongest": "one replica per served model on each of cores 0 and 1",
                        "ours": ({"DiffusionModelGroup (every model)": configs[0].device_map.model}
                                 if args.ours_layout == "shared" else
                                 {config.model.name: config.device_map.model for config in configs})}),
        "max_queued_requests": {system: queue_bound(system, args.strongest_queue)
                                for system in ("production", "strongest")},
        "workload": describe(args, trace, window_s, shapes),
        "lora_file_bytes": lora_bytes, "duration_s": time.monotonic() - began,
        "calibration": calibration, "rows": rows, "figures": figures, "summary": summary,
        "summary_ranges_overlap": ties,
    }
    table = render(args, payload)
    print(table)
    write_results(NAME, payload, table, args.out)
    return payload


def write_loras(args: argparse.Namespace, root: Path) -> int:
    """Each served model's LoRA pool under ``root/<model>/``; the size of one file in bytes."""
    components = load_components(DiffusionModelConfig(preset=args.preset, weights="seeded"))
    targets = LoRATargets.from_modules(components.denoiser, components.text_encoder, components.text_encoder_2)
    size = 0
    for k in range(args.models):
        directory = root / f"m{k}"
        directory.mkdir()
        for i in range(args.loras_per_model):
            size = write_attention_lora(directory / f"{gentd.lora_name(f'm{k}', i)}.safetensors", targets,
                                        rank=args.rank, seed=1000 * k + i)
    return size


def describe(args: argparse.Namespace, trace: Workload, window_s: float, shapes: list) -> dict:
    """How the trace was mapped, for the results."""
    replayed = trace.replayed
    fmt = "%Y-%m-%d %H:%M:%S"
    return {
        "window_utc": [time.strftime(fmt, time.gmtime(trace.start)), time.strftime(fmt, time.gmtime(trace.end))],
        "traced_requests": trace.traced, "replayed_requests": len(replayed), "replayed_window_s": window_s,
        "compression": args.compression, "step_scale": args.step_scale, "model_map": trace.models,
        "kinds": dict(Counter(r.kind for r in replayed)), "n": dict(Counter(str(r.n) for r in replayed)),
        "steps": dict(Counter(str(r.steps) for r in replayed)),
        "loras_per_request": dict(Counter(str(len(r.loras)) for r in replayed)),
        "served_model_requests": dict(Counter(r.model for r in replayed)),
        "shapes": ["/".join(map(str, shape)) for shape in shapes],
        "drawn": "LoRAs per request: distinct, Zipf over the served model's pool; prompts: seeded words of the "
                 "traced lengths; arrivals: uniform within the traced second; LoRA fetch: a traced load latency "
                 "per fetch / compression",
    }


def render(args: argparse.Namespace, payload: dict) -> str:
    figures, summary, ties, w = payload["figures"], payload["summary"], payload["summary_ranges_overlap"], \
        payload["workload"]
    lines = [
        f"# GenTD26 replay: {args.preset} {args.size}x{args.size}, "
        f"{'in one process, no Ray' if args.in_process else 'Ray Serve, 2 cores per system'} "
        f"({payload['machine']['device']}, {args.dtype})",
        "",
        f"Window {w['window_utc'][0]} - {w['window_utc'][1]} UTC: {w['replayed_requests']} requests "
        f"({w['traced_requests']} traced) compressed {args.compression:g}x into {w['replayed_window_s']:.1f} s; "
        f"steps x{args.step_scale:g} ({w['steps']}); kinds {w['kinds']}; n {w['n']}; LoRAs per request "
        f"{w['loras_per_request']}; {args.models} served models ({w['served_model_requests']}), "
        f"{args.loras_per_model} LoRAs each (rank {args.rank}, Zipf {args.zipf:g}). SLO: {args.slo_factor:g}x the "
        f"request shape's unloaded latency on the system that served it. {args.repeats} interleaved repeats. "
        f"Queue bound per model (max_queued_requests; -1: none): {payload['max_queued_requests']}. "
        f"Ours' replicas: {args.ours_layout} (`--ours-layout`), admission_wait_fraction "
        f"{args.admission_wait_fraction}, max_batch_rows {args.max_batch_rows}.",
        "",
        "| system | goodput req/min, median [min-max] | SLO attainment | p50 s | p99 s | ok | good | refused | "
        "errors | timed out |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, figure in figures.items():
        goodput = figure["goodput_per_min"]
        lines.append(f"| {name} | {goodput['median']:.1f} [{goodput['min']:.1f}-{goodput['max']:.1f}] | "
                     f"{_fmt(figure['slo_attainment'])} | {_fmt(figure['p50_s'], 3)} | {_fmt(figure['p99_s'], 3)}"
                     f"{' (max)' if figure['tail'] == 'max' else ''} | "
                     f"{figure['ok']} | {figure['good']} | {figure['refused']} | {figure['errors']} | "
                     f"{figure['timed_out']} |")
    lines += ["", "| summary | value | goodput ranges overlap (tie) |", "|---|---|---|"]
    for key, value in summary.items():
        lines.append(f"| {key} | {_fmt(value, 3)} | {'-' if key not in ties else ('yes' if ties[key] else 'no')} |")
    lines += ["", "Every run:", "",
              "| repeat | system | ok | good | refused | errors | timed out | goodput/min | attainment (t2i / "
              "img2img / inpaint; with LoRAs) | p50 s | p99 s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        by_kind = " / ".join(_fmt(row["slo_attainment_by_kind"].get(kind)) for kind in
                             ("generate", "img2img", "inpaint"))
        lines.append(f"| {row['repeat']} | {row['system']} | {row['ok']} | {row['good']} | {row['refused']} | "
                     f"{row['errors']} | {row['timed_out']} | {row['goodput_per_min']:.1f} | "
                     f"{_fmt(row['slo_attainment'])} ({by_kind}; {_fmt(row['slo_attainment_with_loras'])}) | "
                     f"{_fmt(row['p50_s'], 3)} | {_fmt(row['p99_s'], 3)}{' (max)' if row['tail'] == 'max' else ''} |")
    lines += ["", "Where the answered requests' time went (medians, seconds; server-side timings from the answers: "
                  "`total_s` in the API handler, ours' `queue_s` before its first step, `denoise_s`, `decode_s`; "
                  "`outside_s` = latency - `total_s`):", "",
              "| repeat | system | answers | count | latency | total_s | queue_s | denoise_s | decode_s | outside_s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        for label, figures in row["time_split"].items():
            lines.append(f"| {row['repeat']} | {row['system']} | {label} | {figures['count']} | " + " | ".join(
                _fmt(figures.get(key), 3) for key in ("latency_s", "total_s", "queue_s", "denoise_s", "decode_s",
                                                      "outside_s")) + " |")
    failures = {key: sum(row[key] for row in payload["rows"]) for key in ("refused", "errors", "timed_out")}
    lines += ["", f"Across all runs: {failures['refused']} refusals, {failures['errors']} errors, "
                  f"{failures['timed_out']} timeouts; none counts as good. Latency from each request's scheduled "
                  "send.", f"Drawn where the trace is silent: {w['drawn']}."]
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
