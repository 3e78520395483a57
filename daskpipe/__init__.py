"""daskpipe: pool-based pipeline serving of DNN inference with latency SLOs on Dask."""

from daskpipe.plan.schema import Plan, PlanError
from daskpipe.profiles.model import Profile, ProfileError

__all__ = ["Plan", "PlanError", "Profile", "ProfileError"]
