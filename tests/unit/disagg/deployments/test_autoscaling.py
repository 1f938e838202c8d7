"""Busy-time autoscaling of the two DLRM pools: the meter, the busy fraction, the replica arithmetic, the Serve policy
(as Serve loads it from a config) and the shard server's busy seconds; every clock is a fake one."""

import asyncio
import math
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

import disagg.rpc.server as server_module
from disagg.deployments.autoscaling import (
    BUSY_METRIC,
    DEFAULT_TARGET_UTILIZATION,
    BusyFraction,
    BusyMeter,
    BusyTimePolicy,
    desired_replicas,
)
from disagg.rpc.server import EmbeddingServer
from tests.helpers.clock import ManualClock
from tests.helpers.embedding_shards import Gate, toy_inputs, toy_shard
from tests.unit.disagg.rpc.test_server import lookup_request, stub_for

POLICY_PATH = "disagg.deployments.autoscaling:BusyTimePolicy"


# --- BusyMeter -------------------------------------------------------------------------------------------------

def test_meter_counts_sections_and_the_running_one_up_to_now():
    clock = ManualClock()
    meter = BusyMeter(clock)
    clock.now += 5.0  # idle
    assert meter.busy_seconds() == 0.0
    with meter:
        clock.now += 2.0
        assert meter.busy_seconds() == 2.0
        clock.now += 1.0
    clock.now += 4.0  # idle again
    assert meter.busy_seconds() == 3.0


def test_overlapping_sections_count_once():
    clock = ManualClock()
    meter = BusyMeter(clock)
    meter.__enter__()  # section A starts at 100
    clock.now += 1.0
    meter.__enter__()  # section B starts at 101
    clock.now += 2.0
    meter.__exit__(None, None, None)  # A ends at 103
    clock.now += 1.0
    meter.__exit__(None, None, None)  # B ends at 104
    clock.now += 10.0
    assert meter.busy_seconds() == 4.0  # 100..104, not 3 + 3


def test_a_section_that_raises_still_ends():
    clock = ManualClock()
    meter = BusyMeter(clock)
    with pytest.raises(RuntimeError), meter:
        clock.now += 1.5
        raise RuntimeError("stage failed")
    clock.now += 3.0
    assert meter.busy_seconds() == 1.5


def test_sections_on_many_threads_leave_the_meter_idle():
    clock = ManualClock()
    meter = BusyMeter(clock)
    entered, release = threading.Barrier(9), threading.Event()

    def section() -> None:
        with meter:
            entered.wait(10)
            release.wait(10)

    threads = [threading.Thread(target=section) for _ in range(8)]
    for thread in threads:
        thread.start()
    entered.wait(10)  # all 8 inside
    clock.now += 2.0
    release.set()
    for thread in threads:
        thread.join(10)
    clock.now += 5.0
    assert meter.busy_seconds() == 2.0


# --- BusyFraction ----------------------------------------------------------------------------------------------

def test_fraction_is_the_busy_share_since_the_previous_read():
    clock = ManualClock()
    meter = BusyMeter(clock)
    fraction = BusyFraction(meter.busy_seconds, clock)
    with meter:
        clock.now += 1.0
    clock.now += 3.0
    assert fraction.fraction() == 0.25  # 1 busy of 4 since it was made
    clock.now += 2.0
    assert fraction.fraction() == 0.0
    with meter:  # a section spanning two reads counts in each of them
        clock.now += 1.0
        assert fraction.fraction() == 1.0
        clock.now += 1.0
    clock.now += 1.0
    assert fraction.fraction() == 0.5


def test_fraction_of_no_elapsed_time_is_zero_and_it_stays_within_0_and_1():
    clock = ManualClock()
    counter = iter([0.0, 0.0, 7.0, 6.0])
    fraction = BusyFraction(lambda: next(counter), clock)
    assert fraction.fraction() == 0.0  # no time elapsed
    clock.now += 2.0
    assert fraction.fraction() == 1.0  # 7 busy seconds in 2: a counter started elsewhere
    clock.now += 2.0
    assert fraction.fraction() == 0.0  # a counter going back


# --- desired_replicas ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("busy", "target", "desired"),
    [
        ([0.9], 0.6, 1.5),
        ([0.9, 0.9, 0.6], 0.6, 4.0),
        ([0.3, 0.0], 0.6, 0.5),
        ([0.0, 0.0, 0.0], 0.5, 0.0),
        ([1.0, 1.0], 1.0, 2.0),
    ],
)
def test_desired_replicas_run_the_reported_work_at_the_target(busy, target, desired):
    assert desired_replicas(busy, target) == pytest.approx(desired)


def test_no_report_means_no_estimate():
    assert desired_replicas([], 0.6) is None


@pytest.mark.parametrize("target", [0, 0.0, -0.5, 1.01, math.nan, math.inf, "0.5", None])
def test_a_target_outside_0_to_1_is_refused_naming_it(target):
    with pytest.raises(ValueError, match="target_utilization"):
        desired_replicas([0.5], target)
    with pytest.raises(ValueError, match="target_utilization"):
        BusyTimePolicy(target_utilization=target)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_a_broken_busy_value_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"busy fraction"):
        desired_replicas([0.5, value], 0.6)


# --- BusyTimePolicy --------------------------------------------------------------------------------------------

def _context(busy: dict[str, float] | None, *, target: int = 2, metric: str = BUSY_METRIC) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="EmbeddingShard_0", app_name="dlrm", current_num_replicas=target,
        target_num_replicas=target, running_replicas=[], total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=None if busy is None else (lambda: {metric: busy}), raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None,
    )


def test_policy_asks_for_the_replicas_the_reported_work_needs():
    policy = BusyTimePolicy(target_utilization=0.5)
    assert policy(_context({"r1": 0.9, "r2": 0.8})) == (pytest.approx(3.4), {})
    assert policy(_context({"r1": 0.2, "r2": 0.1}))[0] == pytest.approx(1.0)  # 0.6, raised to one replica
    assert policy(_context({"r1": 0.0}, target=3))[0] == 1.0  # idle: never zero (shards have no cold start)


def test_policy_keeps_the_target_until_a_replica_reports():
    policy = BusyTimePolicy()
    assert policy.target_utilization == DEFAULT_TARGET_UTILIZATION
    assert policy(_context(None, target=3)) == (3, {})
    assert policy(_context({"r1": 0.9}, target=3, metric="other"))[0] == 3


def test_serve_loads_the_policy_and_its_kwargs_from_a_config():
    """What a Serve config's ``autoscaling_config.policy`` holds reaches the controller as a cloudpickled class."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, policy={
        "policy_function": POLICY_PATH, "policy_kwargs": {"target_utilization": 0.5},
    })
    policy_class = config.policy.get_policy()
    policy = policy_class(**config.policy.policy_kwargs)
    assert policy(_context({"r1": 1.0, "r2": 0.6}))[0] == pytest.approx(3.2)


# --- the shard server's busy seconds ---------------------------------------------------------------------------

def test_shard_server_counts_time_with_a_lookup_in_flight(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(server_module, "time", SimpleNamespace(monotonic=clock))

    async def body():
        shard = toy_shard()
        gate = Gate(shard.module)
        server = EmbeddingServer(replace(shard, module=gate))
        assert server.busy_seconds == 0.0
        await server.start()
        try:
            async with stub_for(server) as (stub, _):
                clock.now += 10.0  # idle
                pending = asyncio.ensure_future(stub.Lookup(lookup_request(toy_inputs(shard)), timeout=10))
                assert await asyncio.to_thread(gate.entered.wait, 10)
                clock.now += 3.0
                assert server.busy_seconds == 3.0  # the spell in progress
                clock.now += 1.0
                gate.release.set()
                await pending
                clock.now += 6.0  # idle
                assert server.busy_seconds == 4.0
        finally:
            await server.stop(0)

    asyncio.run(body())
