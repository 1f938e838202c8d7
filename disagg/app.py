"""Ray Serve application builder: ``import_path: disagg.app:build_app`` with ``args`` = ``DLRMAppConfig``.

No ``from __future__ import annotations`` here: Ray (and ``serving.common.serve_config``) validate
``args`` into the builder's parameter annotation only when it is a real pydantic class, not a string.
"""

from ray.serve import Application

from disagg.config import DLRMAppConfig
from disagg.monolithic import MonolithicDLRM


def build_app(args: DLRMAppConfig) -> Application:
    """The monolithic DLRM app, served under the route prefix ``/v2``; a plain dict of args works too."""
    config = DLRMAppConfig.model_validate(args)
    # Room for one full batch running and the next one filling; fewer would cap the batch size.
    return MonolithicDLRM.options(max_ongoing_requests=2 * config.batching.max_batch_size).bind(config)
