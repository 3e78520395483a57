"""A stage's slot: its compute thread runs what is queued on it back to back, as a GPU runs its
stream; a last stage keeps back the outputs its clients already hold until Dask needs them."""

from __future__ import annotations

import asyncio
import time

import torch

from daskpipe.runtime.worker import stage
from daskpipe.runtime.worker.stage import Stage, reply_clients
from tests.helpers import wait_until
from tests.runtime.helpers import deploy_two_stage, frames, reference

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


def test_outputs_their_clients_hold_are_dasks_when_read_and_never_stored_when_released_first(emulated_inproc, monkeypatch):
    """A last stage that handed every client its outputs stores them in Dask's worker state
    ``KEEP_S`` later. Before then, a ``gather`` and a Dask task that take the future find them
    there as usual; a future released before then leaves nothing on the worker; one still held
    is stored when ``KEEP_S`` has passed."""
    keep_s = 2.0
    monkeypatch.setattr(stage, "KEEP_S", keep_s)
    cluster, client = emulated_inproc
    workers = list(cluster.workers.values())
    xs = frames(4)
    expected = reference(xs)
    with deploy_two_stage(client) as svc:
        svc.submit("tiny", xs[0]).result(timeout=30)  # resolved by the scheduler: the client opens its reply stream
        wait_until(lambda: any(reply_clients(w) for w in workers), timeout=30, what="the client's reply stream")

        read = svc.submit("tiny", xs[1])
        torch.testing.assert_close(read.result(timeout=30), expected[1], atol=1e-4, rtol=1e-4)
        started = time.monotonic()
        torch.testing.assert_close(client.gather(read), expected[1], atol=1e-4, rtol=1e-4)
        total = client.submit(torch.sum, read).result(timeout=30)
        torch.testing.assert_close(total, expected[1].sum(), atol=1e-4, rtol=1e-4)
        assert time.monotonic() - started < keep_s / 2  # neither waited for the kept output to be due

        released, held = (svc.submit("tiny", x) for x in xs[2:])
        for future, output in zip((released, held), expected[2:]):
            torch.testing.assert_close(future.result(timeout=30), output, atol=1e-4, rtol=1e-4)
        released_key, held_key = released.key, held.key
        del released
        wait_until(lambda: released_key not in cluster.scheduler.tasks, timeout=30, what="the release")
        wait_until(lambda: any(held_key in w.data for w in workers), timeout=keep_s + 10, what="the held output stored")
        wait_until(  # the scheduler's free-keys to the worker may still be on its way
            lambda: not any(released_key in w.data or released_key in w.state.tasks for w in workers),
            timeout=10,
            what="the released output gone from the workers",
        )
