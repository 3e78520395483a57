"""What a model costs: per-block latency per (GPU type, MPS slices, batch size) and boundary bytes."""

from daskpipe.profiles.model import Profile, ProfileError

__all__ = ["Profile", "ProfileError"]
