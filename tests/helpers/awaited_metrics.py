"""A metrics sink a test can wait on: the engine records an event on its own threads, the test blocks until it has."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from serving.common.metrics import InMemorySink, MetricSpec

TIMEOUT_S = 60  # every wait is bounded, so a bug fails instead of hanging


class AwaitedSink(InMemorySink):
    """An ``InMemorySink`` whose ``wait_for`` blocks until a metric has been recorded ``count`` times."""

    def __init__(self) -> None:
        super().__init__()
        self._recorded = threading.Condition()

    def record(self, metric: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        super().record(metric, value, tags)
        with self._recorded:
            self._recorded.notify_all()

    def wait_for(self, metric: MetricSpec, count: int = 1, **tags: str) -> None:
        """Returns once ``metric`` (with ``tags``) has ``count`` records; fails after ``TIMEOUT_S``."""
        with self._recorded:
            reached = self._recorded.wait_for(lambda: len(self.records(metric, **tags)) >= count, TIMEOUT_S)
        assert reached, f"{metric.name} {tags} was not recorded {count} time(s) within {TIMEOUT_S} s"
