"""Latency of one request in each Katz row (issue 19): swiftserve's engine against diffusers' own pipelines.

One core = one device (on CPU, as ``BENCHMARKING.md`` asks), every thread with one torch thread and pinned:

- device 0 (core 0): diffusers (the main thread); swiftserve's engine loop (UNet steps) and its stage thread
  (text encoder, VAE, PNG);
- device 1 (core 1): swiftserve's ControlNet worker, its CFG worker (a second engine: the unconditional rows, and
  the lower band of the VAE decode) and its LoRA file loads (host work, kept off device 0's core).

The model is built once; the CFG worker's engine and diffusers' pipelines run module copies of their own over its
weight storage (``sharing_weights``), so an SDXL-sized model fits host memory once rather than three times (on CUDA
each moves its own copy to the GPU). Nothing writes those weights but diffusers' ``fuse_lora``, in place: every
diffusers case that fuses a LoRA unfuses it (untimed) before the next case runs.

So swiftserve's ControlNet and parallel-CFG rows use two devices against diffusers' one, as Katz compare latency
(the extra device is the technique). The pools' threads start during the warm-up and are pinned after it; the cores
of every thread, read back after the warm-up and at the end, are the results' ``device_map``, and a thread off its
device aborts the run. On CUDA the same command runs everything on cuda:0 (one GPU = one device) in float16,
unpinned. The same prompt and seed in every row, guidance 7.5 (CFG on), rank-``--rank`` attention LoRAs at 0.8.

- swiftserve (``EngineLoop`` + ``DiffusionEngine``, ``LocalControlNets``, ``LocalCFGWorker``, ``LoRACache``; the
  server's default settings, one LoRA loader thread, LoRA memory budgets as ``--merged-cache-mib`` and
  ``--lora-cache-mib`` set them): 0c-0l; 1c-0l; 0c-1l cold (a LoRA file never requested
  before, written untimed before each run and evicted from the page cache: read from the local disk); 0c-1l cold
  remote (the same, fetched from an emulated remote LoRA store at ``--lora-store-mb-per-s``, so it loads while the
  request denoises: ``summary.ratio_cold_lora_to_0c0l``; each run's ``applied_at_step`` is recorded and one that
  applied it at step 0 is flagged); 0c-1l warm (the LoRA cached and on the device, its
  merged copy built during the warm-up); 1c-1l (the warm LoRA); 0c-0l with parallel CFG; Katz's 3c-2l (three
  ControlNets, two warm LoRAs).
- diffusers (``StableDiffusionPipeline``, ``StableDiffusionControlNetPipeline``): 0c-0l; 1c-0l; 0c-1l cold and
  cold remote (the same fetch time, then ``load_lora_weights`` + ``fuse_lora`` inside the request; unfused and
  unloaded untimed after it); 0c-1l warm and
  1c-1l each twice, the adapter kept loaded (``set_adapters``, unfused) and kept loaded fused once: the faster is
  diffusers' warm; 3c-2l (``MultiControlNetModel``) the same way with both adapters. The LoRA state a case needs is
  set up untimed before it. Parallel CFG has no diffusers counterpart: diffusers' 0c-0l stands beside it.

Every case runs once to warm up, then ``--repeats`` rounds run them interleaved (round robin). Per case: median,
min and max; per row: diffusers / swiftserve and whether the two ranges overlap (a tie). A failed request aborts
the run. ``summary`` holds the ratios issue 19 names (of the two rows' medians); ``summary_paired`` the same ratio
in each round (its two runs minutes apart), so that drift of the machine's speed across rounds can be told apart.
Results: ``<--out>/bench_diffusion.{json,md}``.

    .venv/bin/python -m benchmarks.bench_diffusion [--preset sd15-shape] [--steps 4] [--size 256] [--repeats 5]
        [--rank 64] [--lora-store-mb-per-s 20] [--merged-cache-mib N] [--lora-cache-mib N] [--out benchmarks/results]

An SDXL preset (``--preset sdxl-shape``: SDXL 1.0 base's architecture) runs the same rows against
``StableDiffusionXLPipeline`` and ``StableDiffusionXLControlNetPipeline``; its results are
``bench_diffusion_sdxl.{json,md}``, its summary keys prefixed ``sdxl_`` (issue 22). A Flux preset (``--preset
flux-tiny``) runs them against ``FluxPipeline`` and ``FluxControlNetPipeline``, its guidance (3.5) in the guidance
embedding and CFG as true CFG (``true_cfg_scale`` 4 with a negative prompt), so every row has two branches as SD's
do. Any other preset's are labelled
with its name: ``--preset tiny --size 64 --steps 8`` is the overhead-bound row (Python overhead weighs as on a GPU),
``bench_diffusion_tiny`` with ``tiny_ratio_0c0l`` and ``tiny_ratio_warm_lora`` (ours over diffusers' fastest).

The three ControlNets are one model's weights under three names (``module_sharing_weights``): each costs its
compute, not memory of its own. A UNet ControlNet's encoder is built as an exact copy of the UNet's (training's
start) and runs over the UNet's storage (``share_encoder_with_unet``): the same compute, the encoder's size less
host memory (``controlnet_encoder_shared_bytes`` in the results), without which ``sdxl-shape`` did not fit a 24 GiB
host. diffusers' ``fuse_lora`` writes show in that encoder too while a fused case runs (values, not time: every
fused case unfuses after it). The command runs itself again under ``ALLOCATOR_ENV`` (the glibc malloc settings of
every swiftserve replica, ``allocator_env`` in the results), for both systems.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from diffusers import ControlNetModel
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from benchmarks.common import (
    conditioning_image,
    diffusion_arguments,
    evict_from_page_cache,
    module_sharing_weights,
    share_encoder_with_unet,
    sharing_weights,
    spread,
    write_attention_lora,
)
from benchmarks.records import RESULTS, machine, provenance, summary, timed, write_results
from serving.common.allocator import TUNED_MALLOC_ENV
from serving.common.device import pin_process, resolve_device
from serving.config import EngineConfig, LoRAConfig
from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import CONTROLNET_PRESETS, build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LoRASpec
from serving.engine.cfg import LocalCFGWorker
from serving.engine.types import ControlNetSpec
from serving.lora.cache import LoRACache
from serving.lora.format import LoRATargets, load_lora_file
from serving.lora.registry import LoRARegistry
from serving.lora.weights import LoRAWeights
from serving.preset_catalog import PRESET_FAMILIES
from serving.presets import DiffusionComponents, build_preset

NAME = "bench_diffusion"
OURS, THEIRS = "swiftserve", "diffusers"
#: The ControlNets served (Katz's 3c-2l row uses all three; the others the first): one model's weights under three
#: names, so each costs its compute but no memory of its own.
CONTROLNETS = ("cn0", "cn1", "cn2")
WARM, WARM_2, COLD = "warm", "warm2", "cold"  # diffusers' cold adapter; swiftserve's cold LoRAs are cold<i>
REMOTE = "remote"  # LoRA names read from the (emulated) remote store
SCALE = 0.8  # every LoRA's strength
DEVICE_1_THREADS = ("controlnet", "cfg-worker", "lora-load")  # name prefixes of the pool threads on device 1
ENGINE_LOOP_THREAD = "diffusion-engine-loop"
NATIVE = "native thread "  # how threads Python did not start are named in the device map
#: Goals (<=): issue 19's three; issue 46's overhead bound, ours over diffusers' fastest on 0c-0l and a warm LoRA.
GOALS = {"ratio_1c1l_to_0c0l": 1.10, "ratio_cfg_parallel": 0.65, "ratio_cold_lora_to_0c0l": 1.05,
         "ratio_0c0l": 1.05, "ratio_warm_lora": 1.05}
#: What a preset's result files and summary keys are labelled with (``bench_diffusion_<label>``, ``<label>_...``).
LABELS = {"sd15-shape": "", "sdxl-shape": "sdxl"}
#: A Flux request: its guidance embedded, true CFG on (two branches per step, as the other families' CFG).
FLUX_REQUEST = {"guidance_scale": 3.5, "true_cfg": True, "true_cfg_scale": 4.0, "negative_prompt": "blurry"}

#: One round, in order: each swiftserve row beside its diffusers counterpart; diffusers' adapter cases grouped, so
#: its untimed LoRA set-up (a fused case unfuses after itself) changes as little as it can.
ROUND: tuple[tuple[str, str], ...] = (
    (OURS, "0c-0l"), (THEIRS, "0c-0l"), (OURS, "0c-0l parallel CFG"),
    (OURS, "1c-0l"), (THEIRS, "1c-0l"),
    (OURS, "0c-1l cold"), (THEIRS, "0c-1l cold"),
    (OURS, "0c-1l cold remote"), (THEIRS, "0c-1l cold remote"),
    (OURS, "0c-1l warm"), (THEIRS, "0c-1l warm (adapter)"),
    (OURS, "1c-1l"), (THEIRS, "1c-1l (adapter)"),
    (THEIRS, "0c-1l warm (fused)"), (THEIRS, "1c-1l (fused)"),
    (OURS, "3c-2l"), (THEIRS, "3c-2l (adapters)"), (THEIRS, "3c-2l (fused)"),
)

#: The table's rows: (row, swiftserve's case, diffusers' cases: the fastest by median is its figure).
COMPARISONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("0c-0l", "0c-0l", ("0c-0l",)),
    ("1c-0l", "1c-0l", ("1c-0l",)),
    ("0c-1l cold", "0c-1l cold", ("0c-1l cold",)),
    ("0c-1l cold remote", "0c-1l cold remote", ("0c-1l cold remote",)),
    ("0c-1l warm", "0c-1l warm", ("0c-1l warm (adapter)", "0c-1l warm (fused)")),
    ("1c-1l", "1c-1l", ("1c-1l (adapter)", "1c-1l (fused)")),
    ("3c-2l", "3c-2l", ("3c-2l (adapters)", "3c-2l (fused)")),
    ("0c-0l parallel CFG", "0c-0l parallel CFG", ("0c-0l",)),
)

#: summary key: (numerator, denominator), each (system, row of COMPARISONS: diffusers' fastest case).
SUMMARY: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "ratio_1c1l_to_0c0l": ((OURS, "1c-1l"), (OURS, "0c-0l")),
    "ratio_cfg_parallel": ((OURS, "0c-0l parallel CFG"), (OURS, "0c-0l")),
    "ratio_cold_lora_to_0c0l": ((OURS, "0c-1l cold remote"), (OURS, "0c-0l")),
    "ratio_cold_local_lora_to_0c0l": ((OURS, "0c-1l cold"), (OURS, "0c-0l")),
    "diffusers_over_ours_1c1l": ((THEIRS, "1c-1l"), (OURS, "1c-1l")),
    "diffusers_ratio_1c1l_to_0c0l": ((THEIRS, "1c-1l"), (THEIRS, "0c-0l")),
    "ratio_3c2l_to_0c0l": ((OURS, "3c-2l"), (OURS, "0c-0l")),
    "diffusers_over_ours_3c2l": ((THEIRS, "3c-2l"), (OURS, "3c-2l")),
    "ratio_0c0l": ((OURS, "0c-0l"), (THEIRS, "0c-0l")),
    "ratio_warm_lora": ((OURS, "0c-1l warm"), (THEIRS, "0c-1l warm")),
}


@dataclass(frozen=True)
class Case:
    """One request of a row: ``prepare`` runs untimed before it, ``run`` is timed and returns what to record,
    ``finish`` runs untimed after it (and may return more to record)."""

    run: Callable[[], dict]
    prepare: Callable[[], None] = lambda: None
    finish: Callable[[], dict | None] = lambda: None


@dataclass
class LoRAFiles:
    """The LoRA directory both systems read, and fresh PEFT attention LoRAs written into it."""

    directory: Path
    targets: LoRATargets
    rank: int
    store_bytes_per_s: float
    written: int = 0

    def fetch(self, name: str) -> None:
        """Waits as long as fetching ``<name>.safetensors`` from the remote LoRA store takes, for names of the
        remote-store rows (``remote...``); the local-disk rows read the disk only."""
        if name.startswith(REMOTE):
            time.sleep((self.directory / f"{name}.safetensors").stat().st_size / self.store_bytes_per_s)

    def write(self, name: str) -> int:
        """``<name>.safetensors`` with weights of its own (a new seed each), evicted from the page cache so its
        first load reads the disk, as a cold LoRA would; its size in bytes."""
        self.written += 1
        path = self.directory / f"{name}.safetensors"
        size = write_attention_lora(path, self.targets, self.rank, seed=self.written)
        evict_from_page_cache(path)
        return size


class Devices:
    """On CPU one core = one device: the pool threads named in ``DEVICE_1_THREADS`` on core 1, every other thread
    on core 0, one torch thread each. On CUDA every thread drives cuda:0 and nothing is pinned."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.pinned = device.type == "cpu"
        if self.pinned:
            pin_process([0])  # every thread so far, and those started from here on, begin on core 0

    @staticmethod
    def core(thread_name: str) -> int:
        return 1 if thread_name.startswith(DEVICE_1_THREADS) else 0

    def place(self) -> None:
        """Pins every live Python thread to its core (the pools start their threads on first use)."""
        if self.pinned:
            for thread in threading.enumerate():
                os.sched_setaffinity(thread.native_id, {self.core(thread.name)})

    @staticmethod
    def snapshot() -> dict[str, list[int]]:
        """The cores every thread of the process may run on, as the kernel has them: Python threads by name, the
        others (native libraries' threads) by thread id."""
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        cores = {}
        for task in sorted(os.listdir("/proc/self/task"), key=int):
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                cores[names.get(int(task), f"{NATIVE}{task}")] = sorted(os.sched_getaffinity(int(task)))
        return cores

    def check(self, snapshot: dict[str, list[int]],
              required: tuple[str, ...] = (*DEVICE_1_THREADS, ENGINE_LOOP_THREAD)) -> None:
        """Aborts the run when a thread that does device work (names starting with ``required``, those every row
        starts by default) is missing or off its device, or any thread may run on both cores (a native thread
        inherits the core of the thread that started it)."""
        if not self.pinned:
            return
        missing = [prefix for prefix in required if not any(name.startswith(prefix) for name in snapshot)]
        misplaced = [f"{name} on cores {cores}" for name, cores in snapshot.items()
                     if len(cores) != 1 or (not name.startswith(NATIVE) and cores != [self.core(name)])]
        if missing or misplaced:
            raise RuntimeError(f"device placement broken: missing threads {missing}, misplaced {misplaced}")

    def device_map(self, after_warmup: dict[str, list[int]], at_end: dict[str, list[int]]) -> dict[str, object]:
        if not self.pinned:
            return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."), "pinned": False,
                    "roles": "every thread (diffusers, engine loop, stage, ControlNet, CFG worker, LoRA loads) drives "
                             f"{self.device}: one GPU = one device", "threads_at_end": at_end}
        return {
            "device": "cpu: one core = one device, one torch thread per thread",
            "pinned": True,
            "device 0 (core 0)": "MainThread: diffusers; diffusion-engine-loop: swiftserve's UNet steps; "
                                 "diffusion-stage_*: its text encoder, VAE and PNG encoding",
            "device 1 (core 1)": "controlnet_*: swiftserve's ControlNet; cfg-worker_*: its CFG worker (a second "
                                 "engine: unconditional rows, the VAE decode's lower band); lora-load_*: its "
                                 "LoRA file loads (host work)",
            "threads_after_warmup": after_warmup,
            "threads_at_end": at_end,
        }


class Swiftserve:
    """The serving path in-process: engine loop, ControlNet and CFG worker clients, LoRA cache; the server's
    default engine settings and ``lora``'s. The CFG worker's engine shares ``model``'s weights."""

    def __init__(self, preset: str, model: DiffusionComponents, device: torch.device, dtype: torch.dtype,
                 controlnet: torch.nn.Module, files: LoRAFiles, params: GenerationParams, image: np.ndarray,
                 lora: LoRAConfig) -> None:
        controlnets = LocalControlNets({name: ControlNetRunner(controlnet if index == 0 else
                                                               module_sharing_weights(controlnet), device, dtype)
                                        for index, name in enumerate(CONTROLNETS)}, max_workers=1)
        self.engine = DiffusionEngine(preset, model, device, dtype, merged_lora_bytes=lora.merged_cache_bytes,
                                      lora_merge_after=lora.merge_after_forwards, controlnets=controlnets)
        self.cfg_worker = LocalCFGWorker(DiffusionEngine(preset, sharing_weights(model), device, dtype))
        def load(path: Path) -> LoRAWeights:  # the LoRA cache's own loader, after the remote store's fetch time
            files.fetch(path.stem)
            return load_lora_file(path, self.engine.lora_targets, max_file_bytes=lora.max_file_bytes)

        self.cache = LoRACache(LoRARegistry(files.directory), self.engine.lora_targets, budget_bytes=lora.cache_bytes,
                               max_file_bytes=lora.max_file_bytes, max_workers=lora.load_workers, loader=load)
        self.loop = EngineLoop(self.engine, EngineConfig(), self.cache)
        self._controlnets, self._files, self._params, self._image = controlnets, files, params, image
        self._merge_after = lora.merge_after_forwards
        self._fresh = itertools.count()
        self._cold = ""
        self._images: list[bytes] = []  # the last request's
        self.cases = {
            "0c-0l": Case(self.generate),
            "1c-0l": Case(lambda: self.generate(controlnets=1)),
            "0c-1l cold": Case(lambda: self.generate(loras=(self._cold,)), prepare=self._write_cold,
                               finish=self._distance_from_exact),
            "0c-1l cold remote": Case(lambda: self.generate(loras=(self._cold,)),
                                      prepare=lambda: self._write_cold(REMOTE), finish=self._distance_from_exact),
            "0c-1l warm": Case(lambda: self.generate(loras=(WARM,))),
            "1c-1l": Case(lambda: self.generate(controlnets=1, loras=(WARM,))),
            "0c-0l parallel CFG": Case(lambda: self.generate(parallel_cfg=True)),
            "3c-2l": Case(lambda: self.generate(controlnets=3, loras=(WARM, WARM_2))),
        }

    def generate(self, *, controlnets: int = 0, loras: tuple[str, ...] = (), parallel_cfg: bool = False) -> dict:
        params = replace(self._params, loras=tuple(LoRASpec(name, SCALE) for name in loras),
                         controlnets=tuple(ControlNetSpec(name, self._image, 1.0)
                                           for name in CONTROLNETS[:controlnets]))
        self.engine.cfg_worker = self.cfg_worker if parallel_cfg else None  # read each step; no request runs now
        try:
            result = self.loop.submit(params).result()
        finally:
            self.engine.cfg_worker = None
        self._images = result.images
        return {"timings": result.timings, "lora": asdict(result.lora) if result.lora is not None else None}

    def _distance_from_exact(self) -> dict:
        """Untimed, after a cold-LoRA request: the same request waiting for its LoRA (``lora_mode`` exact; the LoRA
        is cached by now, so it applies from the first step) and the mean absolute difference of the two images'
        pixels, 0-255: what denoising the first steps without the LoRA changed."""
        cold = self._images
        params = replace(self._params, loras=(LoRASpec(self._cold, SCALE),), lora_mode="exact")
        exact = self.loop.submit(params).result().images
        return {"mean_abs_pixel_diff_from_exact": float(np.mean([np.abs(_pixels(a) - _pixels(b)).mean()
                                                                 for a, b in zip(cold, exact, strict=True)]))}

    def _write_cold(self, prefix: str = COLD) -> None:
        self._cold = f"{prefix}{next(self._fresh)}"  # a name never requested before: the cache must load it
        self._files.write(self._cold)

    def settle_warm_loras(self) -> None:
        """After the warm-up round (each warm-LoRA case once), runs each warm combination past
        ``merge_after_forwards`` forwards, so the timed runs see the steady state: the warm LoRA merged, and the
        two-LoRA combination merged only where the merged cache admits it beside the more used warm LoRA."""
        for loras, forwards in (((WARM,), 2 * self._params.num_inference_steps),
                                ((WARM, WARM_2), self._params.num_inference_steps)):
            while forwards <= self._merge_after:
                self.generate(loras=loras)
                forwards += self._params.num_inference_steps

    def close(self) -> None:
        self.loop.stop()
        self.cache.close()
        self.cfg_worker.close()
        self._controlnets.close()


class Diffusers:
    """diffusers' pipelines over ``components`` (modules of their own, which may share another model's weight
    storage), on the calling thread. The UNet's LoRA state (``none``; ``adapter``: the warm LoRA loaded, active at
    ``SCALE``; ``fused``: it fused too; ``cold``: the cold case's LoRA fused) changes untimed between cases; a
    case that fuses unfuses after it, so shared weights are written only while a diffusers case runs."""

    def __init__(self, components: DiffusionComponents, device: torch.device, dtype: torch.dtype,
                 controlnet: torch.nn.Module, files: LoRAFiles, params: GenerationParams, image: np.ndarray) -> None:
        self.plain = components.as_pipeline().to(device=device, dtype=dtype)
        self._control_key = "control_image" if components.family == "flux" else "image"
        self.controlled = components.as_controlnet_pipeline([controlnet]).to(device=device, dtype=dtype)
        self.controlled_3 = components.as_controlnet_pipeline(
            [controlnet, *(module_sharing_weights(controlnet) for _ in CONTROLNETS[1:])]).to(device=device, dtype=dtype)
        for pipe in (self.plain, self.controlled, self.controlled_3):
            pipe.set_progress_bar_config(disable=True)
        self._files, self._params, self._image = files, params, Image.fromarray(image)
        self.state, self.loaded = "none", ()
        self.cases = {
            "0c-0l": self._case(controlnets=0, state="none"),
            "1c-0l": self._case(controlnets=1, state="none"),
            "0c-1l cold": Case(lambda: self._cold(COLD), prepare=lambda: self._prepare_cold(COLD),
                               finish=self.unfuse),
            "0c-1l cold remote": Case(lambda: self._cold(REMOTE), prepare=lambda: self._prepare_cold(REMOTE),
                                      finish=self.unfuse),
            "0c-1l warm (adapter)": self._case(controlnets=0, state="adapter"),
            "1c-1l (adapter)": self._case(controlnets=1, state="adapter"),
            "0c-1l warm (fused)": self._case(controlnets=0, state="fused"),
            "1c-1l (fused)": self._case(controlnets=1, state="fused"),
            "3c-2l (adapters)": self._case(controlnets=3, state="adapters 2"),
            "3c-2l (fused)": self._case(controlnets=3, state="fused 2"),
        }

    def _case(self, *, controlnets: int, state: str) -> Case:
        return Case(lambda: self.generate(controlnets), prepare=lambda: self.set_lora(state),
                    finish=self.unfuse if state.startswith("fused") else lambda: None)

    def unfuse(self) -> None:
        """Back to no LoRA from a fused one (unfused, unloaded), restoring the UNet's weights."""
        self.set_lora("none")

    def generate(self, controlnets: int) -> dict:
        p = self._params
        pipe = {0: self.plain, 1: self.controlled, len(CONTROLNETS): self.controlled_3}[controlnets]
        key = self._control_key
        extra = ({key: self._image, "controlnet_conditioning_scale": 1.0} if controlnets == 1 else
                 {key: [self._image] * controlnets, "controlnet_conditioning_scale": [1.0] * controlnets}
                 if controlnets else {})
        if p.true_cfg:
            extra |= {"negative_prompt": p.negative_prompt, "true_cfg_scale": p.true_cfg_scale}
        pipe(
            prompt=p.prompt, width=p.width, height=p.height, num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale, generator=torch.Generator().manual_seed(p.seed), output_type="np",
            **extra)
        return {"lora_state": self.state}

    def _prepare_cold(self, name: str) -> None:
        self.set_lora("none")
        evict_from_page_cache(self._files.directory / f"{name}.safetensors")

    def _cold(self, name: str) -> dict:
        self._files.fetch(name)
        self._load(name)
        self.plain.fuse_lora(lora_scale=SCALE, adapter_names=[name])
        self.state, self.loaded = "cold", (name,)
        return self.generate(controlnets=0)

    def _load(self, name: str) -> None:
        self.plain.load_lora_weights(str(self._files.directory), weight_name=f"{name}.safetensors", adapter_name=name,
                                     local_files_only=True)

    def set_lora(self, state: str) -> None:
        """Brings the UNet (shared by every pipeline) to LoRA ``state``: its adapters (``LORA_STATES``) loaded,
        active at ``SCALE``, and fused too for the ``fused`` states."""
        if state == self.state:
            return
        if self.state == "cold" or self.state.startswith("fused"):
            self.plain.unfuse_lora()
        wanted = LORA_STATES[state]
        if self.loaded != wanted:
            if self.loaded:
                self.plain.unload_lora_weights()
            for name in wanted:
                self._load(name)
            self.loaded = wanted
        if wanted:
            self.plain.set_adapters(list(wanted), [SCALE] * len(wanted))
            if state.startswith("fused"):
                self.plain.fuse_lora(adapter_names=list(wanted))
        self.state = state


#: diffusers' LoRA states: the adapters each keeps loaded.
LORA_STATES = {"none": (), "adapter": (WARM,), "fused": (WARM,), "adapters 2": (WARM, WARM_2),
               "fused 2": (WARM, WARM_2)}


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def run_case(case: Case) -> dict:
    """``case`` once: its untimed preparation, the timed request, its untimed finish; its seconds and record."""
    case.prepare()
    record: dict = {}
    seconds = timed(lambda: record.update(case.run()), 1)[0]
    record.update(case.finish() or {})
    return {"seconds": seconds, **record}


def _mean_diffs(payload: dict, case: str) -> str:
    diffs = payload["cold_lora_mean_abs_pixel_diff"][case]
    return f"{statistics.median(diffs):.2f} (median; {min(diffs):.2f}-{max(diffs):.2f})"


def overlap(a: dict, b: dict) -> bool:
    """Whether two cases' [min, max] ranges overlap: their ratio is a tie."""
    return a["min_s"] <= b["max_s"] and b["min_s"] <= a["max_s"]


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="sd15-shape", choices=CONTROLNET_PRESETS,
                        help="model preset (tiny: a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    parser.add_argument("--lora-store-mb-per-s", type=float, default=20.0,
                        help="read rate of the emulated remote LoRA store of the `cold remote` rows (both systems)")
    parser.add_argument("--merged-cache-mib", type=int, default=None,
                        help="swiftserve's lora.merged_cache_bytes in MiB (default: the server's, auto); both systems "
                             "share one process, so auto's share of the memory free at start can overcommit a host "
                             "that holds an SDXL-sized model twice over in LoRA state")
    parser.add_argument("--lora-cache-mib", type=int, default=None,
                        help="swiftserve's lora.cache_bytes in MiB (default: the server's)")


def _lora_config(args: argparse.Namespace) -> LoRAConfig:
    """The server's LoRA settings with one loader thread and the memory budgets the command line sets."""
    budgets = {"merged_cache_bytes": None if args.merged_cache_mib is None else args.merged_cache_mib * 2**20,
               "cache_bytes": None if args.lora_cache_mib is None else args.lora_cache_mib * 2**20}
    return LoRAConfig(load_workers=1, **{key: value for key, value in budgets.items() if value is not None})


#: The malloc settings every swiftserve replica starts with (``serving.common.allocator``), for both systems: one
#: arena, so that weight-sized blocks made and freed on different threads (merged LoRA copies, diffusers' fused
#: deltas) are reused by every thread rather than piling up per thread, and no mmap or trimming, so that a request's
#: activations reuse the last one's pages instead of faulting them in again. (A fixed 4 MiB mmap threshold, used
#: before, made every larger tensor a fresh mapping, and the two devices' threads took turns on the memory map's
#: lock; ``benchmarks/results/profiles/README.md`` and ``bench_diffusion_more/page-faults/`` have the figures.)
ALLOCATOR_ENV = TUNED_MALLOC_ENV


def under_allocator_env(module: str) -> None:
    """Run ``python -m module`` with this command's arguments again under ``ALLOCATOR_ENV`` unless it already is
    (glibc reads it at process start)."""
    if any(os.environ.get(name) != value for name, value in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], {**os.environ, **ALLOCATOR_ENV})


def command_line(doc: str, repeats: int, options: Callable[[argparse.ArgumentParser], object] | None = None,
                 ) -> tuple[argparse.Namespace, GenerationParams]:
    """This benchmark's command line (``options`` adds more) and the request of every row (Flux's guidance)."""
    def all_options(parser: argparse.ArgumentParser) -> None:
        _options(parser)
        if options is not None:
            options(parser)

    args, params = diffusion_arguments(doc, steps=4, repeats=repeats, options=all_options)
    if PRESET_FAMILIES[args.preset] == "flux":
        params = replace(params, **FLUX_REQUEST)
    diffusers_logging.set_verbosity_error()  # not a warning per LoRA load that the file has no text-encoder part
    return args, params


@dataclass
class Systems:
    """Both systems over one build of the model (``build_systems``)."""

    ours: Swiftserve
    vanilla: Diffusers
    lora_file_bytes: int
    controlnet_encoder_shared_bytes: int


def build_systems(args: argparse.Namespace, params: GenerationParams, device: torch.device, dtype: torch.dtype,
                  directory: Path) -> Systems:
    """The model built once, one ControlNet (a UNet ControlNet's encoder over the UNet's storage), the LoRA files
    written into ``directory``, and both systems over them (diffusers' modules sharing the weights)."""
    image = conditioning_image(args.size, 0)
    model = build_preset(args.preset)
    # One ControlNet, used by each system on its own device; a UNet's encoder copy shares the UNet's storage.
    controlnet = build_controlnet_preset(args.preset, denoiser=model.denoiser)
    shared_bytes = share_encoder_with_unet(controlnet, model.denoiser) if isinstance(controlnet, ControlNetModel) else 0
    files = LoRAFiles(directory, LoRATargets.from_modules(model.denoiser, model.text_encoder, model.text_encoder_2),
                      args.rank, args.lora_store_mb_per_s * 2**20)
    lora_bytes = files.write(WARM)
    for name in (WARM_2, COLD, REMOTE):
        files.write(name)
    vanilla = Diffusers(sharing_weights(model), device, dtype, controlnet, files, params, image)
    ours = Swiftserve(args.preset, model, device, dtype, controlnet, files, params, image, _lora_config(args))
    return Systems(ours, vanilla, lora_bytes, shared_bytes)


def main() -> None:
    under_allocator_env("benchmarks.bench_diffusion")
    args, params = command_line(__doc__, repeats=5)
    label = LABELS.get(args.preset, args.preset.replace("-", "_"))
    device = resolve_device("auto")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    devices = Devices(device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_systems(args, params, device, dtype, Path(tmp))
        ours, vanilla, lora_bytes = built.ours, built.vanilla, built.lora_file_bytes
        systems = {OURS: ours.cases, THEIRS: vanilla.cases}
        cases = {(system, row): systems[system][row] for system, row in ROUND}
        print(f"{args.preset}, {args.size}x{args.size}, {args.steps} steps, CFG {params.cfg_scale}, rank-"
              f"{args.rank} LoRAs ({lora_bytes / 2**20:.1f} MiB), {device} {str(dtype).removeprefix('torch.')}, "
              f"{torch.get_num_threads()} torch thread(s) per thread", flush=True)
        try:
            for name in (WARM, WARM_2):  # the warm LoRAs in the cache
                ours.cache.get(name).result()
            for case in cases.values():  # warm-up: every case once (and each pool starts its thread)
                run_case(case)
            ours.settle_warm_loras()
            devices.place()
            after_warmup = devices.snapshot()
            devices.check(after_warmup)
            runs: dict[tuple[str, str], list[dict]] = {key: [] for key in cases}
            for repeat in range(args.repeats):
                for key, case in cases.items():
                    runs[key].append(run_case(case))
                    lora = runs[key][-1].get("lora")
                    applied = f"  LoRA applied at step {lora['applied_at_step']}" if lora else ""
                    print(f"  [{repeat + 1}/{args.repeats}] {key[0]:<10} {key[1]:<22} "
                          f"{runs[key][-1]['seconds']:7.2f} s{applied}", flush=True)
            at_end = devices.snapshot()
            devices.check(at_end)
        finally:
            ours.close()

    stats = {key: summary([run["seconds"] for run in repeats]) for key, repeats in runs.items()}
    flags = []
    applied_cold = {case: [run["lora"]["applied_at_step"] for run in runs[(OURS, case)]]
                    for case in ("0c-1l cold", "0c-1l cold remote")}
    cold = runs[(OURS, "0c-1l cold remote")]
    if any(step == 0 for step in applied_cold["0c-1l cold remote"]) or any(run["lora"]["cache_hits"] for run in cold):
        flags.append(f"swiftserve 0c-1l cold remote: not asynchronous in every run (applied at steps "
                     f"{applied_cold['0c-1l cold remote']}, cache hits {[run['lora']['cache_hits'] for run in cold]})")
    figures: dict[tuple[str, str], dict] = {}  # (system, row of COMPARISONS): its case's statistics
    seconds: dict[tuple[str, str], list[float]] = {}  # (system, row of COMPARISONS): its case's runs, round by round
    comparisons = []
    for row, mine, theirs in COMPARISONS:
        best = min(theirs, key=lambda case: stats[(THEIRS, case)]["median_s"])
        figures[(OURS, row)], figures[(THEIRS, row)] = stats[(OURS, mine)], stats[(THEIRS, best)]
        seconds[(OURS, row)], seconds[(THEIRS, row)] = ([run["seconds"] for run in runs[key]]
                                                        for key in ((OURS, mine), (THEIRS, best)))
        comparisons.append({
            "row": row, "swiftserve_case": mine, "diffusers_case": best,
            "diffusers_over_swiftserve": stats[(THEIRS, best)]["median_s"] / stats[(OURS, mine)]["median_s"],
            "ranges_overlap": overlap(stats[(THEIRS, best)], stats[(OURS, mine)]),
            "swiftserve_over_its_0c0l": stats[(OURS, mine)]["median_s"] / stats[(OURS, "0c-0l")]["median_s"],
        })
    ratios = {key: figures[top]["median_s"] / figures[bottom]["median_s"] for key, (top, bottom) in SUMMARY.items()}
    ties = {key: overlap(figures[top], figures[bottom]) for key, (top, bottom) in SUMMARY.items()}
    # each round's ratio of its two runs, minutes apart: what drift of the machine's speed over the rounds leaves out
    paired = {key: spread([a / b for a, b in zip(seconds[top], seconds[bottom], strict=True)])
              for key, (top, bottom) in SUMMARY.items()}

    payload = {
        **provenance(),
        "machine": machine(),
        "device_map": devices.device_map(after_warmup, at_end),
        "args": vars(args),
        "request": {"prompt": params.prompt, "negative_prompt": params.negative_prompt, "size": args.size,
                    "steps": args.steps, "guidance_scale": params.guidance_scale, "cfg_scale": params.cfg_scale,
                    "seed": params.seed, "lora_scale": SCALE},
        "lora_file_bytes": lora_bytes,
        "controlnet_encoder_shared_bytes": built.controlnet_encoder_shared_bytes,
        "allocator_env": ALLOCATOR_ENV,
        "peak_host_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # ru_maxrss: KiB
        "errors": 0,  # a failed request aborts the run
        "flags": flags,
        "cold_lora_mean_abs_pixel_diff": {case: [run["mean_abs_pixel_diff_from_exact"] for run in runs[(OURS, case)]]
                                          for case in ("0c-1l cold", "0c-1l cold remote")},
        "rows": [{"system": system, "case": case, **stats[(system, case)], "repeats": runs[(system, case)]}
                 for system, case in ROUND],
        "comparisons": comparisons,
        "summary": _prefixed(label, ratios),
        "summary_ranges_overlap": _prefixed(label, ties),
        "summary_paired": _prefixed(label, paired),
        "goals": _prefixed(label, {key: f"<= {goal}" for key, goal in GOALS.items()}),
    }
    table = _table(args, device, payload, stats, applied_cold)
    print(table)
    write_results(f"{NAME}_{label}" if label else NAME, payload, table, args.out)


def _prefixed(label: str, values: dict) -> dict:
    """The SD 1.5 shape's summary keys as issue 19 names them; another preset's prefixed with its label
    (``sdxl_...``, ``tiny_...``)."""
    return {f"{label}_{key}" if label else key: value for key, value in values.items()}


def _mib(value: int | None) -> str:
    return "the server's default" if value is None else f"{value} MiB"


def _range(stats: dict) -> str:
    return f"{stats['median_s']:.2f} ({stats['min_s']:.2f}-{stats['max_s']:.2f})"


def _table(args: argparse.Namespace, device: torch.device, payload: dict, stats: dict,
           applied_cold: dict[str, list[int]]) -> str:
    where = "one core = one device" if device.type == "cpu" else f"{device}, float16"
    lines = [
        f"# Katz rows: {args.preset}, {args.size}x{args.size}, {args.steps} steps, CFG, rank-{args.rank} LoRA; "
        f"{payload['machine']['cpu'] if device.type == 'cpu' else payload['machine']['device']} ({where})",
        "",
        f"Commit {payload['commit']}, {payload['date']}: `{payload['command']}`. Seconds per request: median "
        f"(min-max) of {args.repeats} interleaved runs. " + (
            "swiftserve runs its ControlNet, CFG worker and LoRA loads on device 1; diffusers runs on device 0 alone."
            if device.type == "cpu" else "One GPU: both systems and every swiftserve thread (ControlNet, CFG worker, "
            "LoRA loads) share cuda:0, so nothing here runs on a second device.") +
        f" Peak host memory {payload['peak_host_memory_gib']:.1f} GiB (one copy of the weights, shared)." + (
            f" swiftserve's LoRA memory set by the command (merged copies: {_mib(args.merged_cache_mib)}, LoRA cache:"
            f" {_mib(args.lora_cache_mib)})." if args.merged_cache_mib is not None or args.lora_cache_mib is not None
            else ""),
        "",
        "| row | swiftserve (s) | diffusers (s) | diffusers case | diffusers / swiftserve | tie (ranges overlap) "
        "| swiftserve / its 0c-0l |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in payload["comparisons"]:
        lines.append(
            f"| {row['row']} | {_range(stats[(OURS, row['swiftserve_case'])])} | "
            f"{_range(stats[(THEIRS, row['diffusers_case'])])} | {row['diffusers_case']} | "
            f"{row['diffusers_over_swiftserve']:.2f}x | {'tie' if row['ranges_overlap'] else 'no'} | "
            f"{row['swiftserve_over_its_0c0l']:.2f}x |")
    lines += ["", "| summary (goals: issues 19 and 46) | value | goal | tie (ranges overlap) | paired: each round's "
              "ratio, median (min-max) |", "|---|---|---|---|---|"]
    for key, value in payload["summary"].items():
        paired = payload["summary_paired"][key]
        lines.append(f"| `{key}` | {value:.3f} | {payload['goals'].get(key, '')} | "
                     f"{'tie' if payload['summary_ranges_overlap'][key] else 'no'} | "
                     f"{paired['median']:.3f} ({paired['min']:.3f}-{paired['max']:.3f}) |")
    lines += ["", "| system | case | median (s) | min (s) | max (s) | runs |", "|---|---|---|---|---|---|"]
    for system, case in ROUND:
        s = stats[(system, case)]
        lines.append(f"| {system} | {case} | {s['median_s']:.2f} | {s['min_s']:.2f} | {s['max_s']:.2f} | "
                     f"{s['runs']} |")
    lines += [""] + [f"swiftserve {case}: LoRA applied at steps {steps} (0: ready before the first step); the image "
                     f"differs from the exact one (the LoRA from the first step) by "
                     f"{_mean_diffs(payload, case)} of 255 per pixel on average."
                     for case, steps in applied_cold.items()]
    lines.append(f"The remote LoRA store is emulated: a fetch takes file size / {args.lora_store_mb_per_s:g} MB/s, "
                 "for both systems (swiftserve on its loader thread, diffusers inline before `load_lora_weights`).")
    lines += [f"**Flag:** {flag}" for flag in payload["flags"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
