"""Step load: ``--step-users`` more users every ``--step-seconds``, ``--step-count`` times, then the test stops.

Off unless ``--step-users`` is above 0 (the locustfile's init hook then removes the shape, so ``--users``,
``--spawn-rate`` and ``--run-time`` drive the test as usual). While it is on, ``--users`` and ``--spawn-rate`` are
ignored; ``--run-time`` still stops the test early if it is shorter than the steps.
"""

from __future__ import annotations

from locust import LoadTestShape
from settings import Settings


def step_plan(settings: Settings, run_time: float) -> tuple[int, float] | None:
    """(users, spawn rate) at ``run_time`` seconds into the test, or None once the last step is over."""
    step = int(run_time // settings.step_seconds)
    if step >= settings.step_count:
        return None
    return (step + 1) * settings.step_users, settings.step_spawn_rate or float(settings.step_users)


class StepLoadShape(LoadTestShape):
    use_common_options = True  # --users/--spawn-rate/--run-time stay in the web UI and warn nothing when it is off

    def tick(self) -> tuple[int, float] | None:
        settings = Settings.from_options(self.runner.environment.parsed_options if self.runner else None)
        return step_plan(settings, self.get_run_time())
