"""A stage's slot: its compute thread runs what is queued on it back to back, as a GPU runs its stream."""

from __future__ import annotations

import asyncio
import time

from daskpipe.runtime.stage import Stage
from tests.runtime.helpers import deploy_two_stage

HOLD_S = 0.15
BUSY_S = 0.5  # longer than two holds


def test_a_slot_runs_its_queued_batches_back_to_back_while_the_workers_event_loop_is_busy(emulated_inproc):
    """Two probes (a zero sample held ``HOLD_S``) are queued on a slot, then the worker's event loop
    is kept busy for ``BUSY_S``: both holds run meanwhile, so both have ended when the loop is free.
    A slot that needed its event loop to start the next batch would start the second hold only then."""
    cluster, client = emulated_inproc

    async def queue_two_then_keep_the_loop_busy(dask_worker) -> float:
        [stage] = [actor for actor in dask_worker.state.actors.values() if isinstance(actor, Stage)]
        began = time.monotonic()
        probes = [asyncio.ensure_future(stage.probe(token, HOLD_S)) for token in (-1, -2)]
        await asyncio.sleep(0)  # both probes reach the slot
        time.sleep(BUSY_S)
        await asyncio.gather(*probes)
        return time.monotonic() - began

    with deploy_two_stage(client):
        worker = next(iter(cluster.workers.values())).address
        elapsed = client.run(queue_two_then_keep_the_loop_busy, workers=[worker])[worker]
    assert BUSY_S <= elapsed < BUSY_S + HOLD_S / 2
