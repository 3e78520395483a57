"""A request's way in and out: inputs stay with their client until the first stage fetches them
(daskpipe/runtime/wire/inputs.py, daskpipe/runtime/worker/fetch.py), and outputs go from the last stage to the
client with the completion: correct outputs, nothing of the input on the scheduler, and every
request ends right when a worker or a client dies on the way."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import dask.config
import pytest
import torch
from distributed import Client, wait

import daskpipe
from daskpipe.benchmarks.remote_client import RemoteSender
from daskpipe.plan.schema import Plan
from daskpipe.runtime.client import futures as futures_module
from daskpipe.runtime.client.futures import ClientStream
from daskpipe.runtime.client.service import encode_input
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import RequestFailed
from daskpipe.runtime.scheduler.plugin import plugin_of
from daskpipe.runtime.wire import messages
from daskpipe.runtime.wire.inputs import HeldInput
from tests.helpers import wait_until
from tests.runtime.helpers import PAPER_PPIPE, counted, deploy_two_stage, frames, reference, tiny_model, two_stage, with_test_dispatcher

pytestmark = pytest.mark.timeout(180)

FETCHED = (3, 32, 32)
"""12 KB a sample: over ``daskpipe.inline-input-bytes``, so it is fetched from the client."""


def held_and_queued(scheduler) -> list:
    """What the scheduler holds of the queued inputs and of those in flight."""
    plugin = plugin_of(scheduler)
    return [payload for ledger in plugin.models.ledgers.values() for payload, _ in ledger.queued.values()] + [
        payload for ledger in plugin.models.ledgers.values() for flight in ledger.flights.values() for _, payload, _ in flight.retries
    ]


def test_fetched_inputs_give_the_models_outputs_and_the_scheduler_holds_only_their_size(emulated_inproc):
    """Over TCP and over TLS (the fixture's two clusters): the first stage fetches every input from the client."""
    cluster, client = emulated_inproc
    with deploy_two_stage(client, input_shape=FETCHED, slo_ms=2000.0) as svc:
        xs = frames(12, shape=FETCHED)
        futures = svc.map("tiny", xs[:8]) + [svc.submit("tiny", x) for x in xs[8:]]
        seen = held_and_queued(cluster.scheduler)
        assert all(isinstance(p, HeldInput) and p.nbytes == 4 * 3 * 32 * 32 for p in seen), seen
        wait(futures, timeout=30)
        for out, ref in zip(client.gather(futures), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert counted(svc, "tiny", 12)["completed"] == 12
        wait_until(lambda: not svc._stream.held, timeout=10, what="the client to let go of the inputs of ended requests")


def test_small_inputs_ride_the_submission_below_the_configured_size(emulated_inproc):
    cluster, client = emulated_inproc
    with dask.config.set({"daskpipe.inline-input-bytes": 1 << 20}), deploy_two_stage(client, input_shape=FETCHED, slo_ms=2000.0) as svc:
        xs = frames(4, shape=FETCHED)
        futures = svc.map("tiny", xs)
        assert svc._stream.held == {}
        wait(futures, timeout=30)
        for out, ref in zip(client.gather(futures), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_an_input_the_client_no_longer_holds_fails_alone_and_its_batch_mates_complete(emulated_inproc, monkeypatch):
    cluster, client = emulated_inproc
    with deploy_two_stage(client, input_shape=FETCHED, slo_ms=2000.0) as svc:
        lost: list[str] = []
        hand_over = ClientStream.hand_over

        def losing_one(self, worker, fetch):
            if not lost:
                lost.append(fetch["keys"][0])
                self.held.pop(fetch["keys"][0], None)
            hand_over(self, worker, fetch)

        monkeypatch.setattr(ClientStream, "hand_over", losing_one)
        xs = frames(4, shape=FETCHED)
        futures = svc.map("tiny", xs)  # one batch of 4
        wait(futures, timeout=30)
        by_key = {f.key: f for f in futures}
        with pytest.raises(RequestFailed, match="no longer held the input"):
            by_key[lost[0]].result()
        for future, ref in zip(futures, reference(xs)):
            if future.key != lost[0]:
                torch.testing.assert_close(future.result(), ref, atol=1e-4, rtol=1e-4)
        status = counted(svc, "tiny", 4)
        assert status["failed"] == 1 and status["completed"] == 3


def test_requests_from_three_clients_at_once_all_end_with_their_own_outputs(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client, input_shape=FETCHED, slo_ms=5000.0):
        xs = frames(100, seed=7, shape=FETCHED)
        refs = reference(xs)
        outputs: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []
        security = cluster.security

        def send(share: range) -> None:
            try:
                with Client(cluster.scheduler_address, security=security) as own, RemoteSender(own) as sender:
                    futures = {i: sender.submit("tiny", encode_input(xs[i])) for i in share}
                    wait(list(futures.values()), timeout=60)
                    outputs.update({i: f.result() for i, f in futures.items()})
            except BaseException as exc:  # the test thread reports it
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(range(k, 100, 3),)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert sorted(outputs) == list(range(100))
        for i, ref in enumerate(refs):
            torch.testing.assert_close(outputs[i], ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def two_first_slots():
    """A processes cluster of two L4 slots (the first pool) and one T4: a first-stage worker can die
    and its batch run on the other, while this process's client holds the inputs."""
    with EmulatedCluster({"L4": 2, "T4": 1}, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        with_test_dispatcher(client, cluster.scheduler)
        yield cluster, client


def first_pool_of_two(plan: Plan) -> Plan:
    """``plan`` with its first partition's pool two slots wide."""
    (model,) = plan.models
    (pipeline,) = model.pipelines
    first, *rest = pipeline.partitions
    widened = replace(pipeline, partitions=(replace(first, vgpus=2), *rest))
    return replace(plan, models=(replace(model, pipelines=(widened,)),))


@pytest.mark.parametrize("when", ["before the fetch", "after the fetch"])
def test_a_first_stage_worker_killed_around_its_fetch_loses_nothing(two_first_slots, monkeypatch, when):
    """The worker that fetches the first batch is killed, its fetch unanswered, or answered and its
    batch computing: the batch is retried on the other first-stage slot, which fetches the inputs
    again from the client."""
    cluster, client = two_first_slots
    pids = client.run(os.getpid)
    profile, plan = two_stage(input_shape=FETCHED, slo_ms=3000.0, stage_ms=(300.0, 5.0))
    svc = daskpipe.deploy(
        client,
        {"tiny": tiny_model()},
        example_inputs={"tiny": torch.zeros(1, *FETCHED)},
        plan=first_pool_of_two(plan),
        profiles={"tiny": profile},
        elastic=None,
    )
    try:
        victim: list[str] = []
        hand_over = ClientStream.hand_over

        def killing_the_first(self, worker, fetch):
            if victim:
                hand_over(self, worker, fetch)
                return
            victim.append(worker)
            if when == "before the fetch":
                os.kill(pids[worker], signal.SIGKILL)
                return
            hand_over(self, worker, fetch)
            client.loop.call_later(0.1, os.kill, pids[worker], signal.SIGKILL)  # while its 300 ms batch computes

        monkeypatch.setattr(ClientStream, "hand_over", killing_the_first)
        xs = frames(4, shape=FETCHED)
        futures = svc.map("tiny", xs)
        wait(futures, timeout=90)
        assert victim, "no fetch reached the client"
        for future, ref in zip(futures, reference(xs)):
            torch.testing.assert_close(future.result(), ref, atol=1e-4, rtol=1e-4)
        status = counted(svc, "tiny", 4, timeout=30)
        assert status["completed"] == 4 and status.get("retried", 0) >= 4
    finally:
        svc.close()
        client.wait_for_workers(3, timeout=60)  # the Nanny restarts the killed one for the next test


@pytest.mark.parametrize(
    ("input_shape", "upsample", "connect_delay_s"),
    [(FETCHED, 1, 0.0), ((3, 16, 16), 2, 0.0), ((3, 16, 16), 2, 0.6), ((3, 16, 16), 2, None)],
    ids=["fetched inputs", "inline inputs", "inline inputs, streams slower than a pipeline pass", "inline inputs, workers unreachable"],
)
def test_outputs_in_the_clients_hands_survive_the_death_of_the_worker_that_computed_them(
    two_first_slots, monkeypatch, input_shape, upsample, connect_delay_s
):
    """Outputs of 32 KB a request (a batch's 128 KB, over the 64 KiB the scheduler relays) ride
    the completion to the client, the first batch's too: its first submission asked it to open
    streams to every stage's worker, whether its inputs are fetched or ride the submission, and a
    last stage that finishes before the client's stream is up waits for it. The last stage's
    worker is then killed, and Dask loses their keys: the futures stay finished, with their
    outputs. A client that cannot reach the workers (``connect_delay_s=None``) gets them through
    the scheduler. A fresh client each time: none of its streams is open yet."""
    cluster, _ = two_first_slots
    opened = futures_module.open_comm

    async def slow_reply_streams(address, connection_args, handshake, *args, **kwargs):
        if handshake.get("op") == messages.REPLY:
            if connect_delay_s is None:
                raise OSError(f"{address} is behind a firewall")
            await asyncio.sleep(connect_delay_s)
        return await opened(address, connection_args, handshake, *args, **kwargs)

    monkeypatch.setattr(futures_module, "open_comm", slow_reply_streams)
    model = WideOutput(upsample)
    profile, plan = two_stage("wide", input_shape=input_shape, slo_ms=3000.0, stage_ms=(300.0, 5.0), model=model)
    with Client(cluster.scheduler_address) as client:
        with daskpipe.deploy(
            client,
            {"wide": model},
            example_inputs={"wide": torch.zeros(1, *input_shape)},
            plan=plan,
            profiles={"wide": profile},
            elastic=None,
        ) as svc:
            xs = frames(8, shape=input_shape)
            futures = svc.map("wide", xs)
            wait(futures, timeout=60)
            assert all(f.output_in_hand for f in futures)
            (last,) = {a for (_, q, a) in plugin_of(cluster.scheduler).models.ledgers["wide"].stages if q == 1}
            os.kill(client.run(os.getpid, workers=[last])[last], signal.SIGKILL)
            wait_until(lambda: last not in cluster.scheduler.workers, timeout=30, what="the scheduler to lose the worker")
            time.sleep(0.5)  # Dask's report of the lost keys reaches this client
            with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
                patch.setattr(client, "sync", lambda *a, **k: pytest.fail("result() went to the cluster"))
                for future, x in zip(futures, xs):
                    assert future.status == "finished"
                    torch.testing.assert_close(future.result(), model.tail(model.head(x).half().float()), atol=1e-3, rtol=1e-3)
        client.wait_for_workers(3, timeout=60)


class WideOutput(torch.nn.Module):
    """Two stages whose output is a 32 KB feature map a request of 3x32x32 inputs, or of 3x16x16
    ones upsampled twice."""

    def __init__(self, upsample: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
        self.tail = torch.nn.Sequential(torch.nn.Upsample(scale_factor=upsample), torch.nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(x))


@pytest.mark.protocols("tcp")  # the sender process connects over TCP; TLS fetches are tested above
def test_a_client_killed_with_requests_queued_ends_them_as_client_gone_and_leaves_no_key(emulated_inproc):
    """A sender in a process of its own submits requests that the paper's deferred dispatcher holds
    back (a long SLO, batches of 4 not yet full), then is killed: they end at once on the
    scheduler, dropped as "client-gone", and none of their keys is left; the service still serves."""
    cluster, client = emulated_inproc
    slo_s = 4.0
    with deploy_two_stage(client, input_shape=FETCHED, slo_ms=slo_s * 1e3, dispatcher=PAPER_PPIPE) as svc:
        script = (
            "import sys, time, torch\n"
            "from distributed import Client\n"
            "from daskpipe.benchmarks.remote_client import RemoteSender\n"
            f"client = Client({cluster.scheduler_address!r})\n"
            "sender = RemoteSender(client)\n"
            f"futures = [sender.submit('tiny', bytes(4 * {3 * 32 * 32})) for _ in range(3)]\n"
            "print('sent', flush=True)\n"
            "time.sleep(600)\n"
        )
        sender = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout is not None and sender.stdout.readline().strip() == "sent"
            plugin = plugin_of(cluster.scheduler)
            wait_until(lambda: len(plugin.models.ledgers["tiny"].queued) == 3, timeout=30, what="the three requests to be queued")
            keys = list(plugin.models.ledgers["tiny"].queued)
            started = time.monotonic()
            sender.send_signal(signal.SIGKILL)
            status = wait_until(
                lambda: (s := svc.status()["tiny"])["dropped"].get("client-gone", 0) >= 3 and s,
                timeout=30,
                what="the gone client's requests to be dropped",
            )
            assert time.monotonic() - started < slo_s / 2, "ended when the client left, not at their deadline"
            assert status["queued"] == 0
            assert not [k for k in keys if k in cluster.scheduler.tasks]
            xs = frames(4, shape=FETCHED)
            for out, ref in zip(client.gather(svc.map("tiny", xs)), reference(xs)):
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        finally:
            sender.kill()
            sender.wait(10)


def test_a_dispatched_batch_whose_client_left_before_the_fetch_drops_only_that_clients_requests(emulated_inproc):
    """Requests of two clients in one batch; one client's stream to the first stage closes before
    its fetch is answered: its request is dropped as client-gone, the other's completes."""
    cluster, client = emulated_inproc
    with deploy_two_stage(client, input_shape=FETCHED, slo_ms=5000.0) as svc:
        other = Client(cluster.scheduler_address, security=cluster.security)
        sender = RemoteSender(other)
        try:
            original = ClientStream.hand_over
            closing: list[str] = []

            def leave(self, worker, fetch):
                if self is sender.stream and not closing:
                    closing.append(worker)
                    other.loop.add_callback(other.close)
                    return
                original(self, worker, fetch)

            ClientStream.hand_over = leave  # type: ignore[method-assign]
            xs = frames(4, shape=FETCHED)
            theirs = [sender.submit("tiny", encode_input(xs[0]))]
            mine = svc.map("tiny", xs[1:])
            wait(mine, timeout=30)
            for out, ref in zip(client.gather(mine), reference(xs[1:])):
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            status = wait_until(lambda: (s := svc.status()["tiny"])["dropped"].get("client-gone", 0) >= 1 and s, timeout=30, what="a drop")
            assert status["dropped"]["client-gone"] == 1 and theirs
        finally:
            ClientStream.hand_over = original  # type: ignore[method-assign]
            other.close()
