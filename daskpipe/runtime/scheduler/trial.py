"""A deploy's trial of its control path: real batches along the model's routes, under load.

Round trips to the stage workers (pings) say little about a batch's path: they skip the compute
threads' hand-offs, the feature maps' hops and the completion, and twenty of them on a busy
machine gave a seed anywhere from 0.8x to 6x what serving then measured, so that one deploy at
5 ms was accepted and dropped everything while another at 25 ms was refused. Before a model takes
requests, the scheduler plugin therefore sends :func:`trial_batches` batches of one zero sample
along its pipelines, dealt over every pool's slots, at :data:`TRIAL_LOAD` of the batch rate its
plan serves (at most :data:`TRIAL_RATE_MAX` a second), and measures each as it measures a served
batch (:class:`~daskpipe.runtime.scheduler.control.ControlPath`). The deploy is refused when a lone request
plus the high percentile of those batches' delays (:data:`~daskpipe.runtime.scheduler.control.MARGIN_QUANTILE`)
does not fit the SLO; else the model starts serving with that percentile as its margin.

A sample larger than the inputs that ride a submission takes the served path: the deploying client
holds zero inputs (:class:`TrialInputs`) and each batch's first stage fetches its own from it. Sent
through the scheduler instead, fcn's 6.3 MB frames measured the scheduler's relay, a path served
requests no longer take: a control path of 120-255 ms at half load on 2 cores, and every deploy refused.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from daskpipe.runtime.scheduler.batches import Batches
from daskpipe.runtime.scheduler.control import MARGIN_QUANTILE, MAX_SHARE, MIN_BATCHES, MIN_MARGIN_S
from daskpipe.runtime.scheduler.ledger import Flight, Ledger
from daskpipe.runtime.wire.inputs import TRIAL_INPUTS, TRIAL_KEY_PREFIX, HeldInput
from daskpipe.runtime.wire.messages import Hop
from daskpipe.sched.api import Request

TRIAL_BATCHES = TRIAL_INPUTS
"""Batches a trial sends at most: a p99 of 400 is their fifth largest, stable from run to run
where a p99 of 100 is their largest."""
TRIAL_BYTES = 64 * 2**20
"""The inputs a trial sends through the scheduler at most (a trial without :class:`TrialInputs`):
a model of large inputs gets fewer batches."""
TRIAL_LOAD = 0.5
TRIAL_RATE_MAX = 400.0
"""Trial batches a second at most (a plan of a tiny model serves more than a scheduler core sends):
a trial of :data:`TRIAL_BATCHES` takes a second or more, so only a tight SLO has one (:data:`TRIAL_HEADROOM_S`)."""
TRIAL_HEADROOM_S = 0.25
TRIAL_SEEDS = 10.0
"""A model is tried when its tightest budget leaves less than :data:`TRIAL_HEADROOM_S` or this
many times the pings' seed beyond a lone request. The control path's tail reached 90-250 ms on a
2-core machine at load averages 10-30 (docs/benchmarks.md), and the pings' seed of the same minute
said 2-40 ms: a seed says nothing of the next second's load, so an SLO is tried by its headroom,
and a looser one is decided on the pings alone."""
TRIAL_SECONDS = 2.0
"""How long a trial sends for, at most, unless :data:`~daskpipe.runtime.scheduler.control.MIN_BATCHES`
take longer: a plan of slow stages serves a few batches a second, and 400 of them held a deploy for
over a minute (stages of 100 ms: 80 s)."""
TRIAL_TIMEOUT_S = 10.0
"""For the last trial batches to report, past their sending; one not back by then counts at this."""


@dataclass(frozen=True)
class TrialInputs:
    """Zero inputs of one sample that ``client`` holds under ``keys`` for a deploy's trial."""

    client: str
    keys: tuple[str, ...]


def trial_batches(ledger: Ledger, rate: float, held: bool = False) -> int:
    """How many batches ``ledger``'s trial sends at ``rate`` a second: :data:`TRIAL_BATCHES`, fewer
    for what :data:`TRIAL_SECONDS` holds and, unless the inputs are ``held`` by a client, for
    large inputs, never under :data:`~daskpipe.runtime.scheduler.control.MIN_BATCHES`."""
    by_bytes = TRIAL_BATCHES if held else TRIAL_BYTES // max(1, ledger.sample_nbytes)
    return int(min(TRIAL_BATCHES, max(MIN_BATCHES, min(by_bytes, rate * TRIAL_SECONDS))))


async def trial_control_path(
    ledger: Ledger, model: str, batches: Batches, ids: Callable[[], int], inputs: TrialInputs | None = None
) -> list[float]:
    """Send ``served``'s trial (the module docstring) through ``batches`` with dispatch ids from
    ``ids``, its inputs fetched from ``inputs`` when given, and return each batch's control-path
    delay (seconds), as ``served.control`` records it; a batch not back within
    :data:`TRIAL_TIMEOUT_S` counts as that long."""
    entering = [i for i, p in enumerate(ledger.model.pipelines) if p.entry_block == 0]
    if not ledger.sample_nbytes or not entering:  # no sample to send (a hybrid plan's later entries take parked data)
        return []
    headroom = ledger.control.cap_s / MAX_SHARE  # the cap is MAX_SHARE of the headroom (or of the budget)
    if headroom >= max(TRIAL_HEADROOM_S, TRIAL_SEEDS * max(ledger.control.seed_s, MIN_MARGIN_S)):
        return []
    pipelines = [ledger.model.pipelines[i] for i in entering]
    rate = min(TRIAL_RATE_MAX, TRIAL_LOAD * sum(p.throughput / p.batch_size for p in pipelines))
    weights = np.array([p.throughput for p in pipelines], dtype=float)
    count = trial_batches(ledger, rate, held=inputs is not None)
    recorded = ledger.control.recorded
    sent: list[int] = []
    started = time.monotonic()
    for index, pick in enumerate(np.random.default_rng(0).choice(len(weights), size=count, p=weights / weights.sum())):
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        dispatch = ids()
        batches.send(ledger, model, dispatch, trial_flight(ledger, entering[int(pick)], index, dispatch, inputs))
        sent.append(dispatch)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while any(d in ledger.flights for d in sent) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    back = min(ledger.control.recorded - recorded, len(ledger.control.batches))
    totals = [total for _, total in list(ledger.control.batches)[len(ledger.control.batches) - back :]]
    lost = sum(d in ledger.flights for d in sent)
    for dispatch in sent:
        ledger.flights.pop(dispatch, None)
    return totals + [TRIAL_TIMEOUT_S] * lost


def trial_flight(ledger: Ledger, pipeline: int, index: int, dispatch: int, inputs: TrialInputs | None = None) -> Flight:
    """Trial batch ``index``: one zero sample along ``pipeline``, the ``index``-th slot of each
    pool; the sample fetched from ``inputs``' client when given, else sent along."""
    now = time.monotonic()
    route: list[Hop] = []
    planned, spans = [], []
    for partition in range(ledger.durations.partitions(pipeline)):
        slots = sorted(a for (p, q, a) in ledger.stages if (p, q) == (pipeline, partition))
        address = slots[index % len(slots)]
        span = ledger.durations.compute_s(pipeline, partition, 1)
        transfer = ledger.durations.transfer_s(pipeline, partition, 1)
        route.append(
            {
                "address": address,
                "stage": ledger.stages[(pipeline, partition, address)],
                "partition": partition,
                "hold_s": span if address in ledger.emulated else 0.0,
            }
        )
        if partition == 0:  # it starts once its input is in, as a served batch's first stage is planned
            planned.append((0, now + transfer, 0.0))
        else:
            planned.append((partition, -math.inf, transfer))
        spans.append(span)
    key = inputs.keys[index % len(inputs.keys)] if inputs else f"{TRIAL_KEY_PREFIX}{dispatch}"
    payload = HeldInput(inputs.client, ledger.sample_nbytes) if inputs else bytes(ledger.sample_nbytes)
    request = Request(id=key, model=ledger.model.name, arrival=now, deadline=now + ledger.budgets.get(0, 0.0))
    return Flight(
        [key],
        frozenset(str(hop["address"]) for hop in route),
        [(request, payload, 1)],
        planned,
        route=route,
        spans=spans,
        pipeline=pipeline,
        trial=True,
    )


def trial_margin(delays_s: list[float], quantile: float = MARGIN_QUANTILE) -> float:
    """The trial's margin: ``quantile`` of its batches' delays (the model's control path's)."""
    return float(np.quantile(delays_s, quantile)) if delays_s else 0.0


def trial_summary(delays_s: list[float]) -> dict[str, Any]:
    """Milliseconds: the trial's batches, p50, p99 and largest."""
    if not delays_s:
        return {"batches": 0}
    p50, p99 = np.quantile(delays_s, (0.5, MARGIN_QUANTILE))
    return {"batches": len(delays_s), "p50_ms": float(p50) * 1e3, "p99_ms": float(p99) * 1e3, "max_ms": max(delays_s) * 1e3}
