"""Where a DLRM replica's CPU goes under load: py-spy samples every replica process of each system while callers
keep it busy, and the flame summaries land in ``--out`` (``benchmarks/results/profiles/`` by default).

Each system (``--systems``: ``bench_dlrm``'s same-cores systems) is deployed as ``bench_dlrm`` deploys it, driven by
``--clients`` callers at ``--batch`` rows for ``--seconds``, while ``py-spy record`` samples each of its replica
processes (``--rate`` Hz; idle threads left out, so samples are CPU time). Per process it writes the collapsed stacks
(``<label>-<system>-<deployment>.txt``, loadable by speedscope or flamegraph.pl) and one markdown summary
(``<label>.md``): CPU seconds per row, and the frames with the most samples, inclusive and self.

    .venv/bin/python -m benchmarks.profile_dlrm --label before --batch 32 [--systems monolithic disagg_fp32]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from ray import serve

from benchmarks import bench_dlrm
from benchmarks.flames import frame_totals
from benchmarks.records import RESULTS, provenance
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from serving.common.allocator import REPLICA_RUNTIME_ENV
from serving.common.net import free_port
from serving.common.tensors import register_ray_serializer

PROFILES = RESULTS / "profiles"
SYSTEMS = bench_dlrm.SAME_CORES


def summary(label: str, measured: dict[str, Any], top: int, gil: bool) -> str:
    sampled = ("the thread holding the GIL (py-spy `--gil`): Python's own CPU time; native work without the GIL "
               "(torch kernels, gRPC's core) is not in them" if gil else
               "every thread py-spy sees running (threads waiting in native code can count as running)")
    lines = [f"# Flame summary `{label}`", "", f"`{measured['command']}` at {measured['commit']}", "",
             f"Samples are of {sampled}; the CPU µs per row are the processes' whole CPU time. Shares are of each "
             "process's own samples. Collapsed stacks beside this file, one per process.", ""]
    for system, entry in measured["systems"].items():
        lines += [f"## {system}: batch {entry['batch']}, {entry['rows_per_s']:.0f} rows/s, "
                  f"CPU µs per row {entry['cpu_us_per_row_total']:.1f}", "",
                  "| process | CPU µs per row |", "|---|---|"]
        lines += [f"| {role} | {value:.1f} |" for role, value in entry["cpu_us_per_row"].items()]
        lines.append("")
        for process, text in entry["stacks"].items():
            total, inclusive, leaf = frame_totals(text)
            if not total:
                continue
            lines += [f"### {process} ({total} samples)", "", "| frame | inclusive | self |", "|---|---|---|"]
            for frame, samples in inclusive.most_common(top):
                lines.append(f"| `{frame}` | {samples / total:.1%} | {leaf[frame] / total:.1%} |")
            lines += ["", "Most self time:", ""]
            lines += [f"- {samples / total:.1%} `{frame}`" for frame, samples in leaf.most_common(top // 2)]
            lines.append("")
    return "\n".join(lines)


def profile_system(name: str, args: argparse.Namespace, batches: list, port: int) -> dict[str, Any]:
    app = name.replace("_", "-")
    handle = bench_dlrm.deploy([bench_dlrm.app_config(app, args, **SYSTEMS[name])], port)[app]
    for inputs in batches[:8]:
        handle.infer.remote(inputs).result(timeout_s=300)  # warm-up
    processes = bench_dlrm.app_processes(app)
    recorders, outputs = {}, {}
    for title, process in processes.items():
        path = args.out / f"{args.label}-{name}-{title.split('#')[0]}.txt"
        outputs[title] = path
        recorders[title] = subprocess.Popen(
            [args.py_spy, "record", "--pid", str(process.pid), "--rate", str(args.rate), "--duration",
             str(int(args.seconds)), "--format", "raw", "--output", str(path)]
            + (["--native"] if args.native else ["--nonblocking"])  # native unwinding needs the process paused
            + (["--gil"] if args.gil else []),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    disaggregated = SYSTEMS[name]["serving"] == "disaggregated"
    calls_before = _shard_calls(handle) if disaggregated else 0
    cpu_before = bench_dlrm.app_cpu_seconds(app)
    caller_before, machine_before = psutil.Process().cpu_times(), bench_dlrm.machine_cpu()
    served = bench_dlrm.throughput(handle, batches, bench_dlrm.callers(args, args.batch), args.seconds)
    cpu_after = bench_dlrm.app_cpu_seconds(app)
    caller_after, machine_after = psutil.Process().cpu_times(), bench_dlrm.machine_cpu()
    calls = _shard_calls(handle) - calls_before if disaggregated else 0
    for title, recorder in recorders.items():
        _, error = recorder.communicate(timeout=120)
        if recorder.returncode:
            print(f"py-spy failed on {title}: {error.decode()[-500:]}", file=sys.stderr)
    serve.delete(app)
    per_row = {role: 1e6 * (cpu_after[role] - cpu_before.get(role, 0.0)) / max(1, served["rows"]) for role in cpu_after}
    return {"batch": args.batch, "rows_per_s": served["rows_per_s"], "errors": served["errors"],
            "caller_cpu_us_per_row": 1e6 * (sum(caller_after[:2]) - sum(caller_before[:2])) / max(1, served["rows"]),
            "rows_per_shard_call": served["rows"] / calls if calls else None,
            **{f"machine_{share}": value
               for share, value in bench_dlrm.idle_and_steal(machine_before, machine_after).items()},
            "cpu_us_per_row": per_row, "cpu_us_per_row_total": sum(per_row.values()),
            "stacks": {title.split("#")[0]: path.read_text() if path.exists() else ""
                       for title, path in outputs.items()}}


def _shard_calls(handle: Any) -> int:
    """Calls the dense replica behind ``handle`` made to shard 0 so far (one per batch, chunks aside)."""
    return handle.embedding_stats.remote().result(timeout_s=30)[0].calls


def arguments() -> argparse.ArgumentParser:
    parser = bench_dlrm.arguments()
    parser.description = __doc__
    parser.add_argument("--label", required=True, help="name of this profile (before, after, ...)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="sample native (C/C++) frames too")
    parser.add_argument("--gil", action=argparse.BooleanOptionalAction, default=True,
                        help="sample only the thread holding the GIL: Python's own CPU time, without the threads "
                        "py-spy counts as running while they wait in native code")
    parser.add_argument("--top", type=int, default=30, help="frames listed per process")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    # --systems, --out: bench_dlrm's (the profiles go to --out)
    parser.set_defaults(seconds=15.0, systems=["monolithic", "disagg_fp32"], out=PROFILES)
    return parser


def main() -> None:
    args = arguments().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    generator = SyntheticRequests(preset_spec(args.preset), seed=args.batch)
    batches = [dict(zip(("dense", "sparse"), generator.batch(args.batch), strict=True)) for _ in range(args.requests)]
    torch.set_num_threads(1)
    ray.init(num_cpus=psutil.cpu_count(), include_dashboard=False,
             object_store_memory=int(args.object_store_gib * bench_dlrm.GiB),
             runtime_env=REPLICA_RUNTIME_ENV)  # every system's replicas start as ours do
    register_ray_serializer()  # requests travel as numpy arrays, as the replicas' answers do
    measured: dict[str, Any] = {**provenance(), "systems": {}}
    try:
        port = free_port()
        for name in args.systems:
            measured["systems"][name] = profile_system(name, args, batches, port)
            print(name, {k: v for k, v in measured["systems"][name].items() if k != "stacks"}, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    text = summary(args.label, measured, args.top, args.gil)
    (args.out / f"{args.label}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
