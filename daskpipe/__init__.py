"""daskpipe: pool-based pipeline serving of DNN inference with latency SLOs on Dask."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dask.config

from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.model import Profile, ProfileError

if TYPE_CHECKING:
    from daskpipe.runtime.service import Service

__all__ = ["Plan", "PlanError", "Profile", "ProfileError", "dask_setup", "deploy"]

# Every process that runs daskpipe's scheduler plugin imports this package first: here the layers
# are put together, and the runtime's plugin attaches the dashboard's pages by this name.
dask.config.update_defaults({"daskpipe": {"scheduler-extensions": ["daskpipe.dashboard:attach_dashboard"]}})


def deploy(client: Any, models: Any, **kwargs: Any) -> Service:
    """Serve ``models`` on ``client``'s cluster; see :func:`daskpipe.runtime.service.deploy`."""
    from daskpipe.runtime.service import deploy as _deploy

    return _deploy(client, models, **kwargs)


def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload daskpipe``: install daskpipe's scheduler plugin (no pickle needed)."""
    from distributed import Scheduler

    from daskpipe.runtime.plugin import install

    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"daskpipe is a scheduler preload (dask scheduler --preload daskpipe), not a {type(scheduler).__name__} preload")
    install(scheduler)
