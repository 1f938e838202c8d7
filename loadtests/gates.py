"""Pass/fail gates checked when locust quits: the run fails (exit code 1) when a gate's measured value is over its
threshold, with one log line per gate naming it and the value (the gates: loadtests/README.md, "Gates").

With the failure-ratio gate on, the gates, not locust's "any failure is an error" default, decide the exit code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from locust import log as locust_log
from locust.runners import WorkerRunner
from settings import Settings

logger = logging.getLogger("loadtests.gates")


@dataclass(frozen=True)
class GateResult:
    gate: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"gate {self.gate} {'passed' if self.passed else 'FAILED'}: {self.detail}"


def evaluate(stats: Any, *, max_failure_ratio: float | None, max_p95_ms: float | None) -> list[GateResult]:
    """The gates that are on, against locust's ``RequestStats``; p95 overall and per request name (so fast DLRM
    calls cannot hide slow image generations); with any gate on, a run that completed no request fails."""
    if max_failure_ratio is None and max_p95_ms is None:
        return []
    total = stats.total
    if total.num_requests == 0:
        return [GateResult("requests", False, "no request completed, nothing to judge")]
    results = []
    if max_failure_ratio is not None:
        ratio = total.num_failures / total.num_requests
        results.append(GateResult(
            "max-failure-ratio", ratio <= max_failure_ratio,
            f"failure ratio {ratio:.4f} ({total.num_failures} of {total.num_requests} requests) "
            f"{'<=' if ratio <= max_failure_ratio else '>'} {max_failure_ratio:g}",
        ))
    if max_p95_ms is not None:
        named = sorted(
            ((f"{entry.method} {entry.name}", entry) for entry in stats.entries.values() if entry.num_requests),
            key=lambda item: item[0],
        )
        entries = [("all requests", total), *named]
        for label, entry in entries:
            p95 = entry.get_response_time_percentile(0.95)
            results.append(GateResult(
                "max-p95-ms", p95 <= max_p95_ms,
                f"p95 of {label} is {p95:g} ms ({entry.num_requests} requests) "
                f"{'<=' if p95 <= max_p95_ms else '>'} {max_p95_ms:g} ms",
            ))
    return results


def on_quitting(environment: Any, **_kwargs: Any) -> None:
    """Listener of ``events.quitting``: logs every gate and sets ``environment.process_exit_code``."""
    if isinstance(environment.runner, WorkerRunner):
        return  # the master judges the aggregated stats
    settings = Settings.from_options(environment.parsed_options)
    results = evaluate(environment.stats, max_failure_ratio=settings.max_failure_ratio,
                       max_p95_ms=settings.max_p95_ms)
    for result in results:
        (logger.info if result.passed else logger.error)(result.line())
    if not results:
        return
    failed = sorted({result.gate for result in results if not result.passed})
    if failed:
        logger.error("load test FAILED its gates: %s", ", ".join(failed))
        environment.process_exit_code = 1
        return
    logger.info("load test passed its gates")
    ratio_gated = settings.max_failure_ratio is not None
    runner = environment.runner
    if ratio_gated and runner is not None and not runner.exceptions and not locust_log.unhandled_greenlet_exception:
        environment.process_exit_code = 0  # failures within the tolerated ratio are not an error
