"""Arrival processes: Poisson, bursty (gamma inter-arrivals) and trace replay.

Every generator returns sorted arrival times in seconds within ``[0, duration)`` at a mean rate
``rate`` (requests/s), drawn from the ``numpy.random.Generator`` it is given, so a run is fixed by
its seed.

Bursty is a renewal process with gamma inter-arrival gaps of mean ``1/rate`` and coefficient of
variation ``cv`` (shape ``1/cv**2``, scale ``cv**2/rate``): ``cv = 1`` is Poisson, larger is
burstier (Symphony's Γ(shape) workloads; shape 0.25 is cv 2).

Trace files (``load_trace``) come in two formats, told apart by their first line:

* one arrival timestamp in seconds per line (any origin, any order; ``#`` comments allowed);
* a header line ``per-minute`` then one request count per line, one line per minute.

``trace_arrivals`` rescales a trace to ``rate`` by compressing or stretching its time axis (burst
shapes are kept, only their time scale changes) and tiles it when it is shorter than ``duration``.
Per-minute counts become a piecewise-constant Poisson process over ``bin_s``-long bins.

A :class:`Stream` is one source of requests with its own model, rate, latency budget and entry
block (hybrid inference: a device that runs blocks ``[0, k)`` itself sends requests entering at
``k``); ``stream_requests`` merges the arrivals of many streams into the scheduler's ``Request``
objects, carrying ``start_block``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from daskpipe.sched.api import Request

PER_MINUTE_HEADER = "per-minute"


def _check(rate: float, duration: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    if not (duration > 0 and math.isfinite(duration)):
        raise ValueError(f"duration must be a positive number of seconds, got {duration!r}")


def poisson_arrivals(rate: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    return gamma_arrivals(rate, duration, rng, cv=1.0)


def gamma_arrivals(rate: float, duration: float, rng: np.random.Generator, *, cv: float) -> np.ndarray:
    """Renewal process with gamma gaps (mean 1/rate, coefficient of variation ``cv``)."""
    _check(rate, duration)
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a positive number, got {cv!r}")
    shape = 1.0 / cv**2
    expected = rate * duration
    chunks, total, t0 = [], 0, 0.0
    while True:
        gaps = rng.gamma(shape, 1.0 / (shape * rate), size=int(expected - total + 6 * math.sqrt(expected * cv**2 + 1)) + 16)
        times = t0 + np.cumsum(gaps)
        chunks.append(times)
        total += len(times)
        t0 = times[-1]
        if t0 >= duration:
            break
    times = np.concatenate(chunks)
    return times[times < duration]


@dataclass(frozen=True)
class Trace:
    """A loaded trace: ``timestamps`` (seconds from 0) or per-minute ``counts``."""

    timestamps: np.ndarray | None = None
    counts: np.ndarray | None = None
    source: str = "<memory>"


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read trace ({exc.strerror})") from None
    rows = [(i + 1, line.split("#", 1)[0].strip()) for i, line in enumerate(lines)]
    rows = [(n, text) for n, text in rows if text]
    if not rows:
        raise ValueError(f"{path}: trace is empty")
    per_minute = rows[0][1].lower() == PER_MINUTE_HEADER
    values = []
    for n, text in rows[1:] if per_minute else rows:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"{path}:{n}: expected a number, got {text!r} (a per-minute trace starts with a line {PER_MINUTE_HEADER!r})"
            ) from None
        if not math.isfinite(value) or (per_minute and value < 0):
            raise ValueError(f"{path}:{n}: expected a {'non-negative count' if per_minute else 'finite timestamp'}, got {text!r}")
        values.append(value)
    data = np.asarray(values, dtype=float)
    if per_minute:
        if not len(data) or data.sum() <= 0:
            raise ValueError(f"{path}: per-minute trace has no requests")
        return Trace(counts=data, source=str(path))
    if len(data) < 2:
        raise ValueError(f"{path}: a timestamp trace needs at least 2 arrivals")
    data = np.sort(data)
    data -= data[0]
    if data[-1] <= 0:
        raise ValueError(f"{path}: all timestamps are equal; the trace has no rate")
    return Trace(timestamps=data, source=str(path))


def trace_arrivals(trace: Trace, rate: float, duration: float, rng: np.random.Generator, *, bin_s: float = 60.0) -> np.ndarray:
    """Arrivals at mean ``rate`` shaped like ``trace``."""
    _check(rate, duration)
    if trace.timestamps is not None:
        stamps = trace.timestamps
        n = len(stamps)
        span = stamps[-1] * n / (n - 1)  # one mean gap past the last arrival closes the period
        scale = (n / span) / rate
        period = span * scale
        reps = int(duration // period) + 1
        times = (stamps * scale)[None, :] + period * np.arange(reps)[:, None]
        times = times.ravel()
        return times[times < duration]
    counts = trace.counts
    rates = counts / counts.mean() * rate
    bins = int(math.ceil(duration / bin_s))
    rates = np.resize(rates, bins)
    out = []
    for i, r in enumerate(rates):
        if r > 0:
            lo = i * bin_s
            out.append(lo + poisson_arrivals(r, bin_s, rng))
    times = np.concatenate(out) if out else np.empty(0)
    return times[times < duration]


def arrivals(kind: str | Trace, rate: float, duration: float, rng: np.random.Generator, *, cv: float = 2.0) -> np.ndarray:
    """``kind``: ``"poisson"``, ``"bursty"`` (gamma with ``cv``) or a loaded :class:`Trace`."""
    if isinstance(kind, Trace):
        return trace_arrivals(kind, rate, duration, rng)
    if kind == "poisson":
        return poisson_arrivals(rate, duration, rng)
    if kind == "bursty":
        return gamma_arrivals(rate, duration, rng, cv=cv)
    raise ValueError(f"arrivals must be 'poisson', 'bursty' or a trace file, got {kind!r}")


@dataclass(frozen=True)
class Stream:
    """``rate`` req/s of ``model`` from ``source``, entering at ``start_block`` with ``budget_s`` each."""

    source: str
    model: str
    rate: float
    budget_s: float
    start_block: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"stream {self.source!r}: rate must be a positive number of requests/s, got {self.rate!r}")
        if not (self.budget_s > 0 and math.isfinite(self.budget_s)):
            raise ValueError(f"stream {self.source!r}: budget_s must be a positive number of seconds, got {self.budget_s!r}")
        if isinstance(self.start_block, bool) or not isinstance(self.start_block, int) or self.start_block < 0:
            raise ValueError(f"stream {self.source!r}: start_block must be an integer >= 0, got {self.start_block!r}")


def stream_requests(
    streams: Sequence[Stream], duration: float, rng: np.random.Generator, *, kind: str | Trace = "poisson", cv: float = 2.0
) -> list[Request]:
    """The arrivals of every stream (``arrivals(kind, ...)`` each, drawn in order) as ``Request``s
    in time order: id ``(source, i)``, deadline = arrival + the stream's budget, its ``start_block``."""
    requests = []
    for stream in streams:
        for i, t in enumerate(arrivals(kind, stream.rate, duration, rng, cv=cv)):
            requests.append(
                Request(
                    id=(stream.source, i),
                    model=stream.model,
                    arrival=float(t),
                    deadline=float(t) + stream.budget_s,
                    start_block=stream.start_block,
                )
            )
    requests.sort(key=lambda r: r.arrival)
    return requests
