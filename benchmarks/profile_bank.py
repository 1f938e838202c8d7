"""Profile the models of the committed autoconfig profile bank: every configuration of each model's space,
measured on real Ray Serve deployments of this machine (``autoconfig profile``, one process per model).

    .venv/bin/python -m benchmarks.profile_bank [--only NAME ...] [--storage URL] [--bank DIR]

A model already in the bank is skipped; an interrupted one resumes from its study (``--storage``). The templates
and spaces are in ``benchmarks/autoconfig_bank/``; the bank goes to ``benchmarks/results/autoconfig_bank/``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
TEMPLATES = HERE / "autoconfig_bank"
BANK = HERE / "results" / "autoconfig_bank"


@dataclass(frozen=True)
class BankModel:
    """One profiled model: an application of the templates, its workload, SLO and how trials probe it."""

    name: str
    app: str
    space: str
    workload: str
    slo_p99_ms: float
    start_rps: float
    probe_s: float
    warmup_s: float
    max_probes: int = 6
    tolerance: float = 0.25


MODELS = (
    BankModel("dlrm-tiny-rows64", "dlrm-tiny", "dlrm", "rows_per_request=64", 100, 32, 0.75, 0.5),
    BankModel("dlrm-tiny-rows256", "dlrm-tiny", "dlrm", "rows_per_request=256", 100, 8, 0.75, 0.5),
    BankModel("dlrm-small-rows128", "dlrm-small", "dlrm", "rows_per_request=128", 100, 16, 0.75, 0.5),
    BankModel("dlrm-tiny-disaggregated-rows128", "dlrm-tiny-disaggregated", "dlrm", "rows_per_request=128", 100,
              16, 0.75, 0.5),
    BankModel("diffusion-tiny-32px-2steps", "diffusion-tiny", "diffusion", "steps=2,size=32x32", 250, 8, 1.0, 0.5),
    BankModel("diffusion-tiny-32px-6steps", "diffusion-tiny", "diffusion", "steps=6,size=32x32", 500, 4, 1.0, 0.5),
    BankModel("diffusion-tiny-64px-3steps", "diffusion-tiny", "diffusion", "steps=3,size=64x64", 800, 4, 1.0, 0.5),
)


def profile_command(model: BankModel, storage: str, bank: Path) -> list[str]:
    """The ``autoconfig profile`` command line of ``model``."""
    return [
        sys.executable, "-m", "autoconfig.cli", "profile",
        "--config", str(TEMPLATES / "serve_config.yaml"), "--app", model.app,
        "--space", str(TEMPLATES / f"{model.space}_space.yaml"), "--workload", model.workload,
        "--slo-p99-ms", str(model.slo_p99_ms), "--start-rps", str(model.start_rps),
        "--probe-s", str(model.probe_s), "--warmup-s", str(model.warmup_s),
        "--max-probes", str(model.max_probes), "--tolerance", str(model.tolerance),
        "--storage", storage, "--study", model.name, "--bank", str(bank), "--model-name", model.name,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model names to profile (default: all)")
    parser.add_argument("--storage", default="sqlite:///out/autoconfig_bank_studies.db")
    parser.add_argument("--bank", type=Path, default=BANK)
    args = parser.parse_args()
    known = {model.name for model in MODELS}
    unknown = set(args.only or []) - known
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
    Path("out").mkdir(exist_ok=True)
    for model in MODELS:
        if args.only and model.name not in args.only:
            continue
        if (args.bank / f"{model.name}.json").exists():
            print(f"{model.name}: already in {args.bank}, skipped", flush=True)
            continue
        started = time.monotonic()
        code = subprocess.call(profile_command(model, args.storage, args.bank))
        print(f"{model.name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
