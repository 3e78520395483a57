"""daskpipe: pool-based pipeline serving of DNN inference with latency SLOs on Dask."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daskpipe.config import ConfigError, check_settings, update_defaults
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.model import Profile, ProfileError

if TYPE_CHECKING:
    from daskpipe.runtime.service import Service

__all__ = ["ConfigError", "Plan", "PlanError", "Profile", "ProfileError", "dask_setup", "deploy"]

# Every process that runs daskpipe code imports this package first: here daskpipe's config defaults
# are loaded (daskpipe/daskpipe.yaml), among them the dashboard pages the runtime's plugin attaches.
update_defaults()


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
    check_settings()  # a bad daskpipe.* key stops the scheduler now, named, not its first deploy
    install(scheduler)
