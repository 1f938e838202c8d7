"""Ours' warm-LoRA row beside the cases bench_diffusion runs before it: seconds, denoise, decode, minor page faults.

Run from the repository root: ``PYTHONPATH=. MALLOC_ARENA_MAX=1 [MALLOC_...] python <this file> ROUNDS``.
"""
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_diffusion import WARM, WARM_2, Devices, build_systems, command_line, run_case
from serving.common.device import resolve_device

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
sys.argv = ["x", "--repeats", "1"]
args, params = command_line("x", repeats=1)
device = resolve_device("auto")
devices = Devices(device, torch.float32)
with tempfile.TemporaryDirectory() as tmp:
    built = build_systems(args, params, device, torch.float32, Path(tmp))
    ours = built.ours
    systems = {"swiftserve": ours.cases, "diffusers": built.vanilla.cases}
    seq = [("swiftserve", "0c-0l"), ("diffusers", "0c-1l cold remote"), ("swiftserve", "0c-1l warm"),
           ("swiftserve", "0c-1l warm"), ("swiftserve", "0c-0l"), ("diffusers", "0c-1l warm (fused)"),
           ("swiftserve", "0c-1l warm")]
    try:
        for name in (WARM, WARM_2):
            ours.cache.get(name).result()
        for system, case in dict.fromkeys(seq):
            run_case(systems[system][case])
        ours.settle_warm_loras()
        devices.place()
        for r in range(ROUNDS):
            for system, case in seq:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                rec = run_case(systems[system][case])
                seconds = time.perf_counter() - start
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                tim = rec.get("timings") or {}
                print(f"round {r} {system:10} {case:20} {seconds:6.2f} denoise {tim.get('denoise_s', 0):6.2f} "
                      f"decode {tim.get('decode_s', 0):5.2f} minflt {faults}", flush=True)
    finally:
        ours.close()
