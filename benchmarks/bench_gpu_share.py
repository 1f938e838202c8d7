"""What a GPU device share enforces (issue 21, item 1), measured on a real GPU.

``autoconfig`` gives a replica at share ``s`` on GPU ``num_gpus: s`` (Ray's reservation),
``SWIFTSERVE_CUDA_MEMORY_FRACTION=min(s, 1)``, which ``serving.common.device.resolve_device`` applies to the process's
caching allocator, and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where an MPS daemon runs. Each case runs in fresh
processes that read the variable at import, as a replica does:

- memory   one process per share allocates 64 MiB blocks until its allocator refuses: allocated / (share x the
           device's memory) is 1.0 when the cap holds, and no process gets past it.
- side by side   ``1/share`` processes at that share allocate up to their caps at the same time: they fit together.
- compute  fp16 matmuls (4096^2), one process alone, then two at share 0.5 in the same time window: without an MPS
           daemon the GPU time-slices between them, so the share divides memory, not compute.
- mps      (``--mps``) the same under an MPS control daemon of this run's own (private pipe and log directories, so
           no other process of the machine uses it; quit at the end): one process at 100%, one alone at
           ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25``, then two at 50 together. The percentage caps the SMs a process
           may use, so a process at 25 gets a quarter even on an idle GPU.

    python -m benchmarks.bench_gpu_share [--shares 0.25 0.5 1.0] [--seconds 5] [--mps] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.records import RESULTS, machine, provenance, write_results

NAME = "bench_gpu_share"
BLOCK_BYTES = 64 << 20
MATMUL_SIDE = 4096
MPS_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # what autoconfig sets from a GPU share under MPS
WINDOW_IN_S = 15  # children import torch and warm up before their common window opens


def _allocate_until_refused(hold_s: float) -> dict[str, float]:
    """The child of the memory cases: how much this process's allocator gives, in blocks, before refusing."""
    from serving.common.device import resolve_device  # after the parent set the share's variable

    device = resolve_device("cuda")
    held = []
    while True:
        try:
            held.append(torch.empty(BLOCK_BYTES, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            break
    time.sleep(hold_s)  # so processes started together hold their memory at the same time
    return {"allocated_bytes": len(held) * BLOCK_BYTES,
            "total_bytes": torch.cuda.get_device_properties(device).total_memory}


def _matmuls_in_window(start_at: float, seconds: float) -> dict[str, float]:
    """The child of the compute case: fp16 matmul TFLOP/s between ``start_at`` and ``start_at + seconds``."""
    from serving.common.device import resolve_device

    device = resolve_device("cuda")
    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device, dtype=torch.float16)
    b = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device=device, dtype=torch.float16)
    for _ in range(20):  # warm-up, before the window opens
        a @ b
    torch.cuda.synchronize()
    time.sleep(max(0.0, start_at - time.time()))
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        done += 10
    elapsed = time.perf_counter() - started
    return {"tflops": done * 2 * MATMUL_SIDE**3 / elapsed / 1e12, "seconds": elapsed}


def _children(share: float, count: int, *arguments: str, env: dict[str, str] | None = None) -> list[dict[str, float]]:
    """``count`` children at ``share`` (and ``env``), started together; each prints one JSON line."""
    env = {**os.environ, "SWIFTSERVE_CUDA_MEMORY_FRACTION": str(min(share, 1.0)), "SWIFTSERVE_DEVICE": "cuda",
           **(env or {})}
    command = [sys.executable, "-m", "benchmarks.bench_gpu_share", "--child", *arguments]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    outputs = [process.communicate()[0] for process in processes]
    if any(process.returncode for process in processes):
        raise RuntimeError(f"a child at share {share} failed: {[p.returncode for p in processes]}")
    return [json.loads(output.strip().splitlines()[-1]) for output in outputs]


def _mps_daemon_runs() -> bool:
    """Whether an MPS control daemon or server runs (by process name, which the kernel cuts to 15 characters:
    matching command lines would also match any shell that merely names the daemon)."""
    return subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True).returncode == 0


def run(shares: list[float], seconds: float) -> dict:
    memory, side_by_side = [], []
    for share in shares:
        (alone,) = _children(share, 1, "alloc", "0")
        memory.append({"share": share, **alone,
                       "allocated_over_cap": alone["allocated_bytes"] / (min(share, 1.0) * alone["total_bytes"])})
        count = round(1 / share)
        if count > 1:
            together = _children(share, count, "alloc", "3")
            side_by_side.append({"share": share, "processes": count,
                                 "allocated_over_cap": [c["allocated_bytes"] / (share * c["total_bytes"])
                                                        for c in together],
                                 "allocated_over_device": sum(c["allocated_bytes"] for c in together)
                                 / together[0]["total_bytes"]})
    (alone,) = _children(1.0, 1, "matmul", str(time.time() + WINDOW_IN_S), str(seconds))
    halves = _children(0.5, 2, "matmul", str(time.time() + WINDOW_IN_S), str(seconds))
    compute = {"alone_tflops": alone["tflops"], "two_at_half_tflops": [h["tflops"] for h in halves]}
    return {"memory": memory, "side_by_side": side_by_side, "compute": compute, "mps_daemon": _mps_daemon_runs()}


def run_mps(seconds: float) -> dict:
    """The compute case under an MPS daemon of this run's own; ``error`` says why not when it cannot run."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {"error": "nvidia-cuda-mps-control is not on PATH"}
    with tempfile.TemporaryDirectory(prefix="swiftserve-mps-") as directory:
        env = {"CUDA_MPS_PIPE_DIRECTORY": f"{directory}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{directory}/log"}
        for path in env.values():
            os.mkdir(path)
        started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True)
        if started.returncode:
            return {"error": f"nvidia-cuda-mps-control -d: exit {started.returncode} {started.stderr.strip()}"}
        try:
            (full,) = _children(1.0, 1, "matmul", str(time.time() + WINDOW_IN_S), str(seconds), env=env)
            (quarter,) = _children(0.25, 1, "matmul", str(time.time() + WINDOW_IN_S), str(seconds),
                                   env={**env, MPS_PERCENTAGE_ENV: "25"})
            halves = _children(0.5, 2, "matmul", str(time.time() + WINDOW_IN_S), str(seconds),
                               env={**env, MPS_PERCENTAGE_ENV: "50"})
        except RuntimeError as error:
            return {"error": str(error)}
        finally:
            subprocess.run([control], input="quit\n", env={**os.environ, **env}, text=True, timeout=60)
    return {"alone_tflops": full["tflops"], "alone_at_25_tflops": quarter["tflops"],
            "two_at_50_tflops": [h["tflops"] for h in halves]}


def _table(result: dict) -> str:
    lines = ["| share | allocated (GiB) | device (GiB) | allocated / cap |", "|---|---|---|---|"]
    lines += [f"| {m['share']} | {m['allocated_bytes'] / 2**30:.2f} | {m['total_bytes'] / 2**30:.2f} | "
              f"{m['allocated_over_cap']:.3f} |" for m in result["memory"]]
    lines += ["", "| share | processes side by side | each allocated / cap | together / device |", "|---|---|---|---|"]
    lines += [f"| {s['share']} | {s['processes']} | {', '.join(f'{r:.3f}' for r in s['allocated_over_cap'])} | "
              f"{s['allocated_over_device']:.3f} |" for s in result["side_by_side"]]
    compute = result["compute"]
    lines += ["", f"fp16 matmul {MATMUL_SIDE}^2: one process alone {compute['alone_tflops']:.0f} TFLOP/s; two at share "
              f"0.5 together {', '.join(f'{t:.0f}' for t in compute['two_at_half_tflops'])} TFLOP/s "
              f"(MPS daemon running: {result['mps_daemon']})"]
    mps = result.get("mps")
    if mps is not None:
        lines += ["", f"Under an MPS daemon of its own: {mps['error']}" if "error" in mps else
                  f"Under an MPS daemon of its own: one process at 100% {mps['alone_tflops']:.0f} TFLOP/s; one "
                  f"alone at {MPS_PERCENTAGE_ENV}=25 {mps['alone_at_25_tflops']:.0f} TFLOP/s; two at 50 together "
                  f"{', '.join(f'{t:.0f}' for t in mps['two_at_50_tflops'])} TFLOP/s"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each compute window")
    parser.add_argument("--mps", action="store_true", help="also measure under an MPS daemon of this run's own")
    parser.add_argument("--out", type=Path, default=RESULTS / "cuda")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *values = args.child
        numbers = [float(value) for value in values]
        child = _allocate_until_refused(*numbers) if kind == "alloc" else _matmuls_in_window(*numbers)
        print(json.dumps(child))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_share measures a GPU: no CUDA device here")
    result = run(args.shares, args.seconds)
    memory = {f"share_{m['share']}": round(m["allocated_over_cap"], 3) for m in result["memory"]}
    halves = result["compute"]["two_at_half_tflops"]
    summary = {"allocated_over_cap": memory,
               "two_at_half_over_alone_tflops": round(sum(halves) / result["compute"]["alone_tflops"], 3)}
    if args.mps:
        mps = result["mps"] = run_mps(args.seconds)
        if "error" not in mps:
            summary["mps_alone_at_25_over_alone_tflops"] = round(mps["alone_at_25_tflops"] / mps["alone_tflops"], 3)
            summary["mps_two_at_50_over_alone_tflops"] = [round(t / mps["alone_tflops"], 3)
                                                          for t in mps["two_at_50_tflops"]]
    payload = {**provenance(), "machine": machine(), "summary": summary, **result}
    write_results(NAME, payload, f"# {NAME}\n\n`{payload['command']}` at {payload['commit']}\n\n{_table(result)}",
                  args.out)
    print(_table(result))


if __name__ == "__main__":
    main()
