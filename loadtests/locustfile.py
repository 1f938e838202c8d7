"""Locust load test of both applications: ``locust -f loadtests/locustfile.py --host http://127.0.0.1:8000``
(or ``make loadtest``).

Registers the users (``DiffusionUser``, ``DLRMUser``), the step shape and the gates; loadtests/README.md describes
the options, the step shape and the gates.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

# locust imports this file by path: make its sibling modules importable whatever the working directory
HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [HERE]:
    sys.path.insert(0, HERE)

import gevent  # noqa: E402
from dlrm_requests import settings_target  # noqa: E402
from gates import on_quitting  # noqa: E402
from locust import events  # noqa: E402
from settings import Settings, add_arguments  # noqa: E402
from shapes import StepLoadShape  # noqa: E402
from users import DiffusionUser, DLRMUser  # noqa: E402

__all__ = ["DLRMUser", "DiffusionUser", "StepLoadShape"]  # locust collects the user and shape classes named here

logger = logging.getLogger("loadtests")

events.init_command_line_parser.add_listener(add_arguments)
events.quitting.add_listener(on_quitting)


@events.init.add_listener
def _configure(environment: Any, **_kwargs: Any) -> None:
    """Apply ``--user-mix`` to the user classes, switch the step shape off unless it was asked for, and build the
    DLRM requests (exit 2 when the DLRM options cannot give them)."""
    settings = Settings.from_options(environment.parsed_options)
    if settings.user_mix is not None:
        chosen = [cls for cls in environment.user_classes if getattr(cls, "kind", None) in settings.user_mix]
        if not chosen:
            logger.error("--user-mix %s selects none of the users being run (%s)", ",".join(settings.user_mix),
                         ", ".join(cls.__name__ for cls in environment.user_classes))
            sys.exit(2)
        for cls in chosen:
            cls.weight = settings.user_mix[cls.kind]
        environment.user_classes = chosen
    if isinstance(environment.shape_class, StepLoadShape):
        if settings.step_enabled:
            logger.info(
                "step load: +%d users every %gs, %d steps (up to %d users, %gs); --users/--spawn-rate ignored",
                settings.step_users, settings.step_seconds, settings.step_count,
                settings.step_users * settings.step_count, settings.step_seconds * settings.step_count,
            )
        else:
            environment.shape_class = None
    if any(getattr(cls, "kind", None) == "dlrm" for cls in environment.user_classes):
        try:  # the DLRM model's requests, built now so a config they cannot come from stops the run before it starts
            settings_target(settings, settings.seed)
        except ValueError as exc:
            logger.error("DLRM requests: %s", exc)
            sys.exit(2)
    # gevent caches the loop's clock; importing torch and building the DLRM requests took seconds since the hub
    # started, and a stale clock would make locust's --run-time timer fire that much early
    gevent.get_hub().loop.update_now()
    logger.info("users: %s", ", ".join(f"{cls.__name__} (weight {cls.weight:g})" for cls in environment.user_classes))
