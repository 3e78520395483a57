"""The comm protocols daskpipe's clusters and workers accept, and UCX's fallback to TCP."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "tls", "ucx", "inproc")


def ucx_available() -> bool:
    """Whether ``protocol="ucx"`` can work: distributed needs the distributed-ucxx package for it."""
    try:
        import distributed_ucxx  # noqa: F401  (registers the ucx:// backend with distributed)
    except (ImportError, OSError):  # not installed, or its UCX libraries do not load
        return False
    return True


def resolve_protocol(protocol: str) -> str:
    """The protocol to use for ``protocol``: ``"ucx"`` falls back to ``"tcp"`` without distributed-ucxx.

    The fallback is announced as a warning (and in the log) so a benchmark run over TCP is never
    mistaken for one over UCX.
    """
    scheme = protocol.removesuffix("://")
    if scheme not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    if scheme == "ucx" and not ucx_available():
        message = (
            "protocol='ucx' needs the distributed-ucxx package, which is not installed or does not load; "
            "falling back to tcp. Install it with `pip install 'daskpipe[ucx]'` (or 'daskpipe[ucx-cu12]' for a CUDA 12 torch build)."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        logger.warning(message)
        return "tcp"
    return scheme
