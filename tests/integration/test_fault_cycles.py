"""Many fault cycles: no surviving process leaks memory or file descriptors while replicas die around it.

Each cycle, with requests in flight: the `diffusion` app's ControlNet replica is killed (its callers, the model
replica, survive); one replica of an embedding shard is killed, and every 10th cycle all replicas of that shard
(the DLRM ingress and its gRPC channels survive); and, whenever both are up, one of the two base-model replicas
of `diffusion-cfg` is killed (its ingress and CFG worker survive; the other replica keeps serving, so the cycle
does not wait for the slow model start of the replacement). Every in-flight request must get its answer (200,
or 503 with Retry-After) within a bound, and the cycle ends when every app answers again. The RSS and open file
descriptors of every Serve process alive before the first cycle and after the last are sampled after a few
warm-up cycles and then every tenth of the run; a leak climbs with the kills, so the median of the last three
samples may exceed the median of the first three by a few descriptors and MiB only.

Left out of `make test` (marker `soak`); run with

    SWIFTSERVE_FAULT_CYCLES=100 .venv/bin/pytest -m soak -s tests/integration/test_fault_cycles.py
"""

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from disagg.api.codec import encode_infer_request
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from serving.common.memory import serve_processes
from tests.helpers.images import encode_b64, square
from tests.helpers.replicas import kill_replica, running_replicas
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.soak]

CYCLES = int(os.environ.get("SWIFTSERVE_FAULT_CYCLES", "100"))
WARMUP_CYCLES = 3
ANSWER_BOUND_S = 60.0  # an in-flight request's answer must come within this after the kill
RECOVERY_BOUND_S = 180.0
MAX_FD_GROWTH = 8
MAX_RSS_GROWTH_MIB = 64.0
SAMPLES = 10  # footprints over the run: after the warm-up, then every CYCLES / SAMPLES cycles
ENDS = 3  # growth compares the medians of the first and the last ENDS samples
MODEL, CONTROLNET = f"DiffusionModel_{DEFAULT_MODEL}", f"ControlNet_edges_{DEFAULT_MODEL}"  # what requests reach

CONTROLNET_BODY = {"prompt": "a square", "size": "128x128", "num_inference_steps": 40, "seed": 1,
                   "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
BASE_BODY = {"prompt": "a red circle", "size": "128x128", "num_inference_steps": 60, "seed": 2}
PROBE_BODY = {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "seed": 3,
              "controlnets": [{"name": "edges", "image": encode_b64(square())}]}


def _dlrm_body() -> bytes:
    dense, sparse = SyntheticRequests(preset_spec("tiny"), seed=5).batch(4)
    body = encode_infer_request({"dense_features": dense, "sparse_features": sparse})
    return body.model_dump_json(exclude_none=True).encode()


def _post(http: httpx.Client, path: str, **kwargs) -> tuple[httpx.Response, float]:
    response = http.post(path, **kwargs)
    return response, time.monotonic()


def _assert_answered(response: httpx.Response, answered_at: float, killed_at: float, what: str) -> None:
    assert response.status_code in (200, 503), f"{what}: {response.status_code} {response.text}"
    if response.status_code == 503:
        assert response.headers.get("retry-after"), f"{what}: 503 without Retry-After"
    assert answered_at - killed_at < ANSWER_BOUND_S, f"{what}: answered {answered_at - killed_at:.0f} s after the kill"


def _wait_until_ok(http: httpx.Client, path: str, **kwargs) -> None:
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while (response := http.post(path, **kwargs)).status_code != 200:
        assert response.status_code == 503, response.text
        assert time.monotonic() < deadline, f"{path} did not recover: {response.text}"
        time.sleep(0.5)


def _wait_for_replicas(app: str, deployment: str, count: int) -> None:
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while len(running_replicas(app, deployment)) != count:
        assert time.monotonic() < deadline, f"{app} {deployment} has not {count} replicas again"
        time.sleep(0.5)


def _cycle(http: httpx.Client, number: int, dlrm_body: bytes) -> int:
    """One cycle of kills; returns how many base-model replicas it killed (0 or 1)."""
    headers = {"content-type": "application/json"}
    shard = f"EmbeddingShard_{number % 2}"
    base_replicas = running_replicas("diffusion-cfg", MODEL)
    kill_base = len(base_replicas) == 2
    dlrm_statuses: list[tuple[int, float]] = []
    streaming = threading.Event()
    streaming.set()

    def stream_dlrm() -> None:
        while streaming.is_set():
            response, at = _post(http, "/v2/models/dlrm/infer", content=dlrm_body, headers=headers)
            dlrm_statuses.append((response.status_code, at))

    with ThreadPoolExecutor(4) as pool:
        dlrm = pool.submit(stream_dlrm)
        try:
            in_flight = [("ControlNet request",
                          pool.submit(_post, http, "/v1/images/generations", json=CONTROLNET_BODY))]
            if kill_base:  # two requests: Serve spreads them over both replicas, so one runs on the killed one
                in_flight += [("base-model request", pool.submit(_post, http, "/cfg/v1/images/generations",
                                                                 json=BASE_BODY)) for _ in range(2)]
            time.sleep(1.5)  # the generations are denoising
            killed_at = time.monotonic()
            kill_replica(running_replicas("diffusion", CONTROLNET)[0])
            shard_replicas = running_replicas("dlrm", shard)
            for replica in shard_replicas if number % 10 == 0 else shard_replicas[:1]:
                kill_replica(replica)
            if kill_base:
                kill_replica(base_replicas[0])
            for what, future in in_flight:
                _assert_answered(*future.result(timeout=ANSWER_BOUND_S + 30), killed_at, what)
            time.sleep(1.0)
        finally:
            streaming.clear()
        dlrm.result(timeout=60)
    for status, at in dlrm_statuses:
        assert status in (200, 503), status
        assert status == 200 or at - killed_at < ANSWER_BOUND_S

    _wait_until_ok(http, "/v1/images/generations", json=PROBE_BODY)
    _wait_until_ok(http, "/cfg/v1/images/generations", json=PROBE_BODY)
    _wait_until_ok(http, "/v2/models/dlrm/infer", content=dlrm_body, headers=headers)
    _wait_for_replicas("dlrm", shard, 2)
    _wait_for_replicas("diffusion", CONTROLNET, 1)
    return int(kill_base)


def _footprint() -> dict[str, tuple[int, float]]:
    """Open file descriptors and RSS (MiB) of every Serve process, by ``<title>#<pid>``."""
    result = {}
    for name, process in serve_processes().items():
        try:
            result[name] = (process.num_fds(), process.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            continue
    return result


def _descriptors(process: psutil.Process) -> str:
    """What a process's descriptors are: sockets by state (and how many peers), files, the rest (pipes, epoll...)."""
    sockets = process.net_connections(kind="all")
    states: dict[str, set] = {}
    for connection in sockets:
        states.setdefault(connection.status, set()).add(connection.raddr or None)
    files = len(process.open_files())
    parts = [f"{state} x{sum(1 for c in sockets if c.status == state)} ({len(peers)} peers)"
             for state, peers in sorted(states.items())]
    return ", ".join([*parts, f"files x{files}", f"other x{process.num_fds() - len(sockets) - files}"])


@pytest.mark.timeout(600 + 120 * (CYCLES + WARMUP_CYCLES))
def test_fault_cycles_leak_no_memory_or_file_descriptors_in_surviving_processes(http):
    dlrm_body = _dlrm_body()
    long_lived = set(serve_processes())
    for number in range(WARMUP_CYCLES):
        _cycle(http, number + 1, dlrm_body)
    samples = [_footprint()]
    every = max(1, CYCLES // SAMPLES)
    started, base_kills = time.monotonic(), 0
    for number in range(CYCLES):
        base_kills += _cycle(http, number + 1, dlrm_body)
        if (number + 1) % every == 0 or number + 1 == CYCLES:
            samples.append(_footprint())
            print(f"cycle {number + 1}/{CYCLES}: {time.monotonic() - started:.0f} s", flush=True)

    survivors = sorted(long_lived & samples[0].keys() & samples[-1].keys())
    curves = {name: [sample[name] for sample in samples if name in sample] for name in survivors}
    print(f"\n{CYCLES} cycles in {time.monotonic() - started:.0f} s: {CYCLES} ControlNet replicas, {CYCLES} shard "
          f"replicas ({CYCLES // 10} whole-shard outages), {base_kills} base-model replicas killed; "
          f"processes alive throughout, open fds and RSS MiB after warm-up and every {every} cycles:")
    for name, curve in curves.items():
        print(f"  {name}\n    fds {' '.join(str(fds) for fds, _ in curve)}\n"
              f"    RSS {' '.join(f'{mib:.0f}' for _, mib in curve)}")
    titles = {name.split("#")[0] for name in survivors}
    assert {"ServeReplica:diffusion:ImagesIngress", f"ServeReplica:diffusion:{MODEL}",
            "ServeReplica:diffusion-cfg:ImagesIngress", f"ServeReplica:diffusion-cfg:CFGWorker_{DEFAULT_MODEL}",
            "ServeReplica:dlrm:DisaggregatedDLRM", "ProxyActor"} <= titles, titles
    assert base_kills >= CYCLES // 4, f"only {base_kills} base-model replicas were killed"
    for name, curve in curves.items():
        fds, rss = _growth([fds for fds, _ in curve]), _growth([mib for _, mib in curve])
        if fds > MAX_FD_GROWTH:
            print(f"{name} holds {curve[-1][0]} fds: {_descriptors(serve_processes()[name])}")
        assert fds <= MAX_FD_GROWTH, f"{name} leaks file descriptors: {curve}"
        assert rss <= MAX_RSS_GROWTH_MIB, f"{name} grew {rss:.0f} MiB: {curve}"


def _growth(curve: list[float]) -> float:
    """From the first samples to the last: the median of the last ``ENDS`` minus the median of the first (a
    socket open at one instant, a connection from a replica being replaced, is not a leak)."""
    return statistics.median(curve[-ENDS:]) - statistics.median(curve[:ENDS])
