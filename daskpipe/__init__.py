"""daskpipe: pool-based pipeline serving of DNN inference with latency SLOs on Dask."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from daskpipe.config import ConfigError, check_settings, update_defaults
from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.model import Profile, ProfileError

if TYPE_CHECKING:
    from daskpipe.profiles.memory import ModelMemory
    from daskpipe.runtime.client.pools import SharedPools, SubCluster
    from daskpipe.runtime.client.service import Service, deploy
    from daskpipe.runtime.deploying.profiling import ProfilingOptions
    from daskpipe.runtime.scheduler.elastic.state import ElasticSettings

__all__ = [
    "ConfigError",
    "ElasticSettings",
    "ModelMemory",
    "Plan",
    "PlanError",
    "PlannerOptions",
    "Profile",
    "ProfileError",
    "ProfilingOptions",
    "Service",
    "SharedPools",
    "SubCluster",
    "dask_setup",
    "deploy",
]

# Every process that runs daskpipe code imports this package first: here daskpipe's config defaults
# are loaded (daskpipe/daskpipe.yaml), among them the dashboard pages the runtime's plugin attaches.
update_defaults()

# The runtime's names load on first use: they import torch, which a scheduler started with
# `--preload daskpipe` never needs. The objects themselves, not wrappers, so that help() and
# inspect.signature() show their real parameters.
_LAZY = {
    "deploy": "daskpipe.runtime.client.service",
    "Service": "daskpipe.runtime.client.service",
    "ProfilingOptions": "daskpipe.runtime.deploying.profiling",
    "ElasticSettings": "daskpipe.runtime.scheduler.elastic.state",
    "SharedPools": "daskpipe.runtime.client.pools",
    "SubCluster": "daskpipe.runtime.client.pools",
    "ModelMemory": "daskpipe.profiles.memory",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload daskpipe``: install daskpipe's scheduler plugin (no pickle needed)."""
    from distributed import Scheduler

    from daskpipe.runtime.scheduler.plugin import install

    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"daskpipe is a scheduler preload (dask scheduler --preload daskpipe), not a {type(scheduler).__name__} preload")
    check_settings()  # a bad daskpipe.* key stops the scheduler now, named, not its first deploy
    install(scheduler)
