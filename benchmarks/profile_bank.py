"""Profile the models of the committed autoconfig profile bank: every configuration of each model's space,
measured on real Ray Serve deployments of this machine (``autoconfig profile``, one process per model), then
raced: measured again until the three best by their means have three runs each (at most eight configurations
repeated; the entry's noise).

    .venv/bin/python -m benchmarks.profile_bank [--only NAME ...] [--storage URL] [--bank DIR]
        [--top-up DIR [--remeasure-starting]]

A model already in the bank is skipped; an interrupted one resumes from its study (``--storage``), so the hours
a bank takes can be spread over several runs. ``--top-up DIR`` keeps the grids of DIR's entries and measures only
what they still miss: the repeats their racing needs (``tuner.repeat_best``) and the app as configured (the
entry's ``starting``, what tuning gains over, with the entry's best measured again right after it, so that the gain
compares two measurements of one session), writing the topped-up entries to ``--bank``. ``--remeasure-starting``
drops the entries' starting points, so that the top-up measures each again beside its best (for a starting point
measured sessions before its optimum, on a machine whose speed has since moved).
Before profiling (or topping up) a diffusion model it measures its workload's unloaded latency (``--unloaded``) and
refuses to start where the model's SLO is not about five times it (``--skip-slo-check`` profiles anyway).
The templates and spaces are in ``benchmarks/autoconfig_bank/``; the bank goes to
``benchmarks/results/autoconfig_bank_v2/`` (the first bank, ``autoconfig_bank/``, was measured with unenforced
shares and coarse probes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.schema import ServeApplicationSchema

HERE = Path(__file__).parent
TEMPLATES = HERE / "autoconfig_bank"
BANK = HERE / "results" / "autoconfig_bank_v2"


@dataclass(frozen=True)
class BankModel:
    """One profiled model: an application of the templates, its workload, SLO and the first rate probed; probes
    are the ``autoconfig`` defaults (1 s scouts, deciding probes of 200 requests, bisection to 2.5%)."""

    name: str
    app: str
    workload: str
    slo_p99_ms: float
    start_rps: float
    space: str = "bank"
    warmup_s: float = 1.0


#: Models whose optima differ: compute per request (rows), SLO, table size and storage, and layout.
MODELS = (
    BankModel("dlrm-tiny-rows16-slo100", "dlrm-tiny", "rows_per_request=16", 100, 8),
    BankModel("dlrm-tiny-rows1-slo40", "dlrm-tiny", "rows_per_request=1", 40, 8),
    BankModel("dlrm-tiny-rows256-slo200", "dlrm-tiny", "rows_per_request=256", 200, 4),
    BankModel("dlrm-tiny-rows1024-slo500", "dlrm-tiny", "rows_per_request=1024", 500, 2),
    BankModel("dlrm-tiny-rows64-slo80", "dlrm-tiny", "rows_per_request=64", 80, 8),  # none of 48 held 40 ms
    BankModel("dlrm-small-rows64-slo100", "dlrm-small", "rows_per_request=64", 100, 8),
    BankModel("dlrm-small-rows512-slo300", "dlrm-small", "rows_per_request=512", 300, 2),
    BankModel("dlrm-small-rows4-slo60", "dlrm-small", "rows_per_request=4", 60, 8),
    BankModel("dlrm-tiny-disagg-rows64-slo150", "dlrm-tiny-disagg-shards", "rows_per_request=64", 150, 4),
    BankModel("dlrm-tiny-disagg-rows512-slo400", "dlrm-tiny-disagg-shards", "rows_per_request=512", 400, 2),
    # A shard at 0.25 CPU is throttled for up to 75 ms of each 100 ms CFS period: its p99 carries that wait.
    BankModel("dlrm-tiny-disagg-rows8-slo120", "dlrm-tiny-disagg-shards", "rows_per_request=8", 120, 4),
    BankModel("dlrm-small-int8-disagg-rows128-slo200", "dlrm-small-int8-disagg-shards", "rows_per_request=128",
              200, 4),
    # Diffusion: SLOs about five times each workload's unloaded latency on the profiling machine (``--unloaded``;
    # measured in the bank's README, checked before each profile); the search starts at 2 rps (it never probes
    # under its start).
    BankModel("diffusion-tiny-32px-2steps-slo180", "diffusion-tiny", "size=32x32,steps=2", 180, 2, space="diffusion"),
    BankModel("diffusion-tiny-64px-4steps-slo430", "diffusion-tiny", "size=64x64,steps=4", 430, 2, space="diffusion"),
    BankModel("diffusion-sdxl-tiny-32px-4steps-slo470", "diffusion-sdxl-tiny", "size=32x32,steps=4", 470, 2,
              space="diffusion"),
    BankModel("diffusion-sd3-tiny-32px-4steps-slo220", "diffusion-sd3-tiny", "size=32x32,steps=4", 220, 2,
              space="diffusion"),
    BankModel("diffusion-tiny-loras-32px-4steps-slo400", "diffusion-tiny-loras",
              "size=32x32,steps=4,loras=outlined|dark|outlined+dark|", 400, 2, space="diffusion"),
)


def profile_command(model: BankModel, storage: str, bank: Path) -> list[str]:
    """The ``autoconfig profile`` command line of ``model``."""
    return [
        sys.executable, "-m", "autoconfig.cli", "profile",
        "--config", str(TEMPLATES / "serve_config.yaml"), "--app", model.app,
        "--space", str(TEMPLATES / f"{model.space}_space.yaml"), "--workload", model.workload,
        "--slo-p99-ms", str(model.slo_p99_ms), "--start-rps", str(model.start_rps),
        "--warmup-s", str(model.warmup_s), "--repeat-best", "3", "--repeats", "3", "--repeat-limit", "8",
        "--storage", storage, "--study", model.name, "--bank", str(bank), "--model-name", model.name,
    ]


def template_app(name: str) -> ServeApplicationSchema:
    """The application ``name`` of the bank's templates, its args validated by its builder's model."""
    from autoconfig.serve_config import load_serve_config

    apps = {app.name: app for app in load_serve_config(TEMPLATES / "serve_config.yaml").applications}
    return apps[name]


def unloaded_latency_ms(model: BankModel, requests: int = 20, warmup: int = 2) -> float:
    """The median latency of ``requests`` sequential requests of a diffusion ``model``'s workload through the images
    API on an in-process backend of its template app, torch on one thread (a replica of one CPU), without Ray or
    HTTP; the first ``warmup`` requests are not counted. A diffusion model's SLO is about five times it."""
    import statistics

    import torch
    from fastapi.testclient import TestClient

    from autoconfig.workloads import parse_workload_options, workload_for_app
    from serving.api.models import ServedModel, ServedModels
    from serving.api.server import create_images_api
    from serving.config import DiffusionAppConfig
    from serving.engine import LocalBackend

    app = template_app(model.app)
    if app.import_path != "serving.app:build_app":
        raise ValueError(f"{model.name}: unloaded latency is measured for diffusion apps only")
    workload = workload_for_app(app.import_path, app.args, parse_workload_options(model.workload))
    config = DiffusionAppConfig.model_validate(app.args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend = LocalBackend.from_config(config)
    latencies = []
    try:
        with TestClient(create_images_api(ServedModels([ServedModel(backend, config)]))) as client:
            for index in range(warmup + requests):
                started = time.perf_counter()
                response = client.request(workload.method, workload.path, content=workload.body(index),
                                          headers={"content-type": "application/json"})
                elapsed_ms = 1000 * (time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"{model.name}: request {index} answered {response.status_code}: "
                                       f"{response.text[:200]}")
                if index >= warmup:
                    latencies.append(elapsed_ms)
    finally:
        backend.close()
        torch.set_num_threads(threads)
    return statistics.median(latencies)


#: The multiples of the unloaded latency a diffusion model's SLO may be on the profiling machine.
SLO_MULTIPLE_RANGE = (4.5, 5.5)


def slo_line(model: BankModel, unloaded_ms: float) -> str:
    """``model``'s SLO beside its workload's unloaded latency ``unloaded_ms``, and the multiple it is of it."""
    return (f"{model.name}: unloaded {unloaded_ms:.1f} ms, SLO {model.slo_p99_ms:g} ms = "
            f"{model.slo_p99_ms / unloaded_ms:.1f}x")


def slo_calibration_error(model: BankModel, unloaded_ms: float) -> str | None:
    """Why ``model``'s SLO does not fit a machine where its workload's unloaded latency is ``unloaded_ms`` (its SLO
    outside ``SLO_MULTIPLE_RANGE`` of it), or None: a bank entry's SLO is about five times that latency."""
    low, high = SLO_MULTIPLE_RANGE
    if low <= model.slo_p99_ms / unloaded_ms <= high:
        return None
    return (f"{slo_line(model, unloaded_ms)} here, outside {low:g}-{high:g}x: this machine is not the one the SLO was "
            f"set on; set the SLOs from `--unloaded` here (the model's name carries its SLO) or profile where they "
            f"were set")


def seed_study(storage: str, source: Path, *, remeasure_starting: bool = False) -> None:
    """Copies the bank entry ``source`` into a new study of its model's name, unless a study of that name (an
    interrupted top-up) exists; ``remeasure_starting`` leaves the entry's starting point out, so that ``profile``
    measures it again, and refuses an existing study that still holds the entry's own."""
    from autoconfig.bank import BankEntry
    from autoconfig.study import StudyError, TuningStudy

    entry = BankEntry.load(source)
    if remeasure_starting:
        entry = entry.model_copy(update={"starting": None})
    try:
        study = TuningStudy.load(storage, entry.name)
    except StudyError:
        TuningStudy.open(storage, entry.name, entry.space).add_bank_entry(entry)
        return
    starting = study.starting_point()
    if remeasure_starting and starting is not None and "reference_config" not in starting:
        raise StudyError(f"study {entry.name!r} in {storage} holds a starting point measured without its best "
                         f"beside it (the entry's own), which --remeasure-starting is to measure again: give a "
                         f"--storage without that study")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model names to profile (default: all)")
    parser.add_argument("--storage", default="sqlite:///out/autoconfig_bank_studies.db")
    parser.add_argument("--bank", type=Path, default=BANK)
    parser.add_argument("--top-up", type=Path, metavar="DIR", help="a bank whose entries' grids are kept and whose "
                        "missing repeats are measured")
    parser.add_argument("--remeasure-starting", action="store_true", help="with --top-up: measure the entries' "
                        "starting points again, each beside its best")
    parser.add_argument("--skip-slo-check", action="store_true", help="profile a diffusion model even where its SLO "
                        f"is outside {SLO_MULTIPLE_RANGE[0]:g}-{SLO_MULTIPLE_RANGE[1]:g}x its unloaded latency here")
    parser.add_argument("--unloaded", action="store_true", help="print each diffusion model's unloaded latency "
                        "(median of 20 sequential requests on an in-process backend of one thread) and its SLO's "
                        "multiple of it, and profile nothing")
    args = parser.parse_args()
    if args.remeasure_starting and not args.top_up:
        parser.error("--remeasure-starting needs --top-up DIR")
    known = {model.name for model in MODELS}
    unknown = set(args.only or []) - known
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
    if args.unloaded:
        for model in MODELS:
            if model.space == "diffusion" and (not args.only or model.name in args.only):
                print(slo_line(model, unloaded_latency_ms(model)), flush=True)
        return 0
    Path("out").mkdir(exist_ok=True)
    for model in MODELS:
        if args.only and model.name not in args.only:
            continue
        if (args.bank / f"{model.name}.json").exists():
            print(f"{model.name}: already in {args.bank}, skipped", flush=True)
            continue
        if args.top_up:
            from autoconfig.study import StudyError

            if not (args.top_up / f"{model.name}.json").exists():
                print(f"{model.name}: not in {args.top_up}, skipped", flush=True)
                continue
            try:
                seed_study(args.storage, args.top_up / f"{model.name}.json",
                           remeasure_starting=args.remeasure_starting)
            except StudyError as error:
                print(f"error: {error}", file=sys.stderr, flush=True)
                return 2
        if model.space == "diffusion" and not args.skip_slo_check:
            unloaded_ms = unloaded_latency_ms(model)
            error = slo_calibration_error(model, unloaded_ms)
            if error:
                print(error, file=sys.stderr, flush=True)
                return 2
            print(f"{slo_line(model, unloaded_ms)} here", flush=True)
        started = time.monotonic()
        code = subprocess.call(profile_command(model, args.storage, args.bank))
        print(f"{model.name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
