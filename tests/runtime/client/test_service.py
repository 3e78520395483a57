"""End-to-end tests of serving through Dask: futures, errors, drops, emulation, attainment."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.util
import re
import threading
import time

import dask.config
import numpy as np
import pytest
import torch
from distributed import as_completed, wait

import daskpipe
from daskpipe.runtime.client import futures as futures_module
from daskpipe.runtime.client.futures import ServedFuture
from daskpipe.runtime.client.service import open_stream
from daskpipe.runtime.deploying.profiling import ProfilingOptions
from daskpipe.runtime.errors import DeployError, InvalidRequest, RequestDropped, RequestFailed
from daskpipe.runtime.wire import messages
from daskpipe.runtime.worker.stage import reply_clients
from tests.helpers import paced, settle_heap, wait_until, wait_until_async
from tests.runtime.helpers import (
    INPUT,
    PAPER_PPIPE,
    deploy_two_stage,
    example,
    frames,
    reference,
    serve_at_load_factor,
    tiny_model,
    two_stage,
)

pytestmark = pytest.mark.timeout(120)


def test_deploy_profiles_plans_and_serves_on_plain_cpu_workers(cpu_cluster):
    cluster, client = cpu_cluster
    model = tiny_model()
    svc = daskpipe.deploy(
        client,
        {"cpu-tiny": model},
        example_inputs={"cpu-tiny": example()},
        slo_ms={"cpu-tiny": 500},
        profiling=ProfilingOptions(num_blocks=2),
    )
    try:
        assert {p.gpu for m in svc.plan.models for pipe in m.pipelines for p in pipe.partitions} == {"cpu"}
        assert svc.profiles["cpu-tiny"].gpu_types == ["cpu"]
        xs = frames(12)
        futures = svc.map("cpu-tiny", xs)
        outputs = client.gather(futures)
        with torch.inference_mode():
            for x, out in zip(xs, outputs):
                torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)
    finally:
        svc.close()


def test_two_stages_on_emulated_pools_match_the_model_and_work_with_dask_waiting(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        xs = frames(10)
        futures = svc.map("tiny", xs[:6]) + [svc.submit("tiny", x) for x in xs[6:]]
        done, not_done = wait(futures, timeout=30)
        assert not not_done
        assert sum(1 for _ in as_completed(futures)) == len(futures)
        for out, ref in zip(client.gather(futures), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        stages = [f.result() for f in svc._stages]
        assert sorted((s.info().result()["partition"], s.info().result()["emulated"]) for s in stages) == [(0, True), (1, True)]
        status = svc.status()["tiny"]
        assert status["completed"] == 10 and status["failed"] == 0


def test_result_waits_and_hands_over_the_output_without_the_clients_event_loop(emulated_inproc):
    """A synchronous ``result()`` waits in the caller's thread, finished or pending, and times out
    there; an erred future still raises its error, there too. (The eager dispatcher sends the
    lone request at once: PPipe's may hold it to its last moment, where a stall of a loaded
    machine drops it.)"""
    cluster, client = emulated_inproc
    with deploy_two_stage(client, dispatcher="eager") as svc:
        xs = frames(4)
        futures = svc.map("tiny", xs)
        wait(futures, timeout=30)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(client, "sync", lambda *a, **k: pytest.fail("result() went through the client's event loop"))
            for future, ref in zip(futures, reference(xs)):
                torch.testing.assert_close(future.result(), ref, atol=1e-4, rtol=1e-4)
            pending = svc.submit("tiny", xs[0])  # not done in 1 ms: its two stages alone take 10
            with pytest.raises(TimeoutError):
                pending.result(timeout=0.001)
            torch.testing.assert_close(pending.result(timeout=30), reference(xs[:1])[0], atol=1e-4, rtol=1e-4)
            bad = svc.submit("tiny", torch.full((1, *INPUT), float("nan")))
            with pytest.raises(InvalidRequest):
                bad.result(timeout=30)


@pytest.mark.protocols("tcp")
def test_the_services_as_completed_yields_each_future_once_as_it_ends_without_the_clients_event_loop(emulated_inproc):
    """Futures ended before they are added, added while iterating, added twice, and erred: each is
    yielded once, and iteration ends when none is left; it times out, and takes no other futures."""
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        xs = frames(6)
        early = svc.map("tiny", xs[:3])
        wait(early, timeout=30)
        bad = svc.submit("tiny", torch.full((1, *INPUT), float("nan")))
        completed = svc.as_completed([*early, bad], timeout=60)
        later = svc.map("tiny", xs[3:])
        for future in [*later, early[0]]:
            completed.add(future)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(client, "sync", lambda *a, **k: pytest.fail("as_completed went through the client's event loop"))
            seen = list(completed)
            outputs = {id(f): f.result() for f in seen if f.status == "finished"}
        assert sorted(map(id, seen)) == sorted(map(id, [*early, bad, *later]))
        assert bad.status == "error"
        # a request the busy test process held past its SLO ends dropped: an end all the same, which
        # as_completed must yield once; any other state of a yielded future is a bug
        unfinished = {
            f.key: (f.status, f.exception(timeout=5) if f.status == "error" else None) for f in [*early, *later] if id(f) not in outputs
        }
        assert all(isinstance(error, RequestDropped) for _, error in unfinished.values()), (
            f"yielded, but not finished when read: {unfinished}"
        )
        assert len(unfinished) < len(xs), f"every request was dropped: {unfinished}"
        for future, ref in zip([*early, *later], reference(xs)):
            if id(future) in outputs:
                torch.testing.assert_close(outputs[id(future)], ref, atol=1e-4, rtol=1e-4)
        busy = threading.Event()
        client.loop.add_callback(lambda: busy.set() or time.sleep(1.0))  # the client's event loop is busy for a second
        assert busy.wait(10)
        began = time.monotonic()
        assert len(list(svc.as_completed(later))) == len(later)
        assert time.monotonic() - began < 0.5
        with pytest.raises(TimeoutError, match="had not ended"):
            next(svc.as_completed([svc.submit("tiny", xs[0])], timeout=0.001))  # not done in 1 ms: its two stages alone take 10
        with pytest.raises(TypeError, match="distributed.as_completed"):
            svc.as_completed([client.submit(abs, -1)])


def reply_streams_of(cluster, client) -> int:
    """How many of the cluster's workers resolve ``client``'s futures themselves."""
    return sum(client.id in reply_clients(worker) for worker in cluster.workers.values())


def test_a_client_that_serves_collects_garbage_on_the_schedulers_thresholds(emulated_inproc, default_thresholds):
    """A client holds a few dozen objects per request in flight: at CPython's thresholds, bursts set
    off full collections of its whole heap (torch's included)."""
    cluster, client = emulated_inproc
    stream = open_stream(client)  # this cluster's scheduler shares the process: deploying would raise them there
    try:
        assert gc.get_threshold() == (2100, 30, 30)
    finally:
        client.sync(stream.close)


def test_the_last_stage_hands_outputs_to_the_client_before_the_scheduler_hears_of_them(emulated_inproc):
    """With its first requests the client is asked to open reply streams to the stages' workers; the
    last stage's then finishes the client's futures itself: an output is in hand
    while the scheduler still counts its request in flight, and a ``gather`` that races the
    scheduler's hearing of it still returns it."""
    cluster, client = emulated_inproc
    scheduler = cluster.scheduler
    with deploy_two_stage(client, slo_ms=2000.0) as svc:  # whole batches of 4 go at once; the watch waits 2 SLOs
        xs = frames(8)
        wait(svc.map("tiny", xs[:4]), timeout=30)
        wait_until(lambda: reply_streams_of(cluster, client) == 2, timeout=10, what="the reply streams from both stages' workers")
        heard = scheduler.stream_handlers[messages.DONE]

        def hear_late(**msg):
            asyncio.get_running_loop().call_later(1.0, functools.partial(heard, **msg))

        scheduler.stream_handlers[messages.DONE] = hear_late
        try:
            futures = svc.map("tiny", xs[4:])
            outputs = [future.result(timeout=30) for future in futures]
            in_flight = svc.status()["tiny"]
            gathered = client.gather(futures)
        finally:
            scheduler.stream_handlers[messages.DONE] = heard
        assert in_flight["completed"] == 4 and in_flight["in_flight"] == 4
        for output, gathered_output, ref in zip(outputs, gathered, reference(xs[4:])):
            torch.testing.assert_close(output, ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(gathered_output, output)
        wait_until(lambda: svc.status()["tiny"]["completed"] == 8, timeout=10, what="the scheduler to count the requests")


def test_a_client_whose_resolutions_are_lost_still_gets_its_outputs_through_dasks_report(emulated_inproc, monkeypatch):
    """Dask's ``key-in-memory`` report reaches a client with a daskpipe stream too, a moment after
    the resolution (the backstop should one be lost); the output is then fetched from the worker."""
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        xs = frames(8)
        wait(svc.map("tiny", xs[:4]), timeout=30)
        wait_until(lambda: reply_streams_of(cluster, client) == 2, timeout=10, what="the reply streams from both stages' workers")
        monkeypatch.setattr(futures_module.ClientStream, "resolve", lambda self, keys, outputs: None)
        futures = svc.map("tiny", xs[4:])
        for future, ref in zip(futures, reference(xs[4:])):
            torch.testing.assert_close(future.result(timeout=30), ref, atol=1e-4, rtol=1e-4)


def test_a_client_without_a_daskpipe_stream_that_wants_a_served_key_is_told_when_it_is_in_memory(emulated_inproc):
    """A client that wants a key without a daskpipe stream (here a plain Dask client informing the
    scheduler of its futures, as Dask's client does when it reconnects) learns of the output from
    Dask's report, as of any key."""
    from distributed import Client, Future

    cluster, client = emulated_inproc
    with (
        deploy_two_stage(client, stage_ms=(300.0, 300.0), slo_ms=5_000.0) as svc,
        Client(cluster.scheduler_address, security=cluster.security) as other,
    ):
        xs = frames(4)
        futures = svc.map("tiny", xs)
        wait_until(lambda: svc.status()["tiny"]["in_flight"] == 4, timeout=10, what="the batch in flight")
        theirs = [Future(future.key, client=other) for future in futures]
        other._inform_scheduler_of_futures()
        wait_until(
            lambda: all(other.id in {cs.client_key for cs in cluster.scheduler.tasks[f.key].who_wants} for f in futures),
            timeout=10,
            what="the plain client to want the keys",
        )
        assert svc.status()["tiny"]["completed"] == 0  # it wanted them while they were in flight
        for future, ref in zip(theirs, reference(xs)):
            torch.testing.assert_close(future.result(timeout=30), ref, atol=1e-4, rtol=1e-4)


def test_a_client_that_cannot_reach_the_workers_gets_its_outputs_through_the_scheduler(emulated_inproc, monkeypatch):
    cluster, client = emulated_inproc
    wait_until(lambda: reply_streams_of(cluster, client) == 0, timeout=10, what="earlier services' reply streams to close")
    with deploy_two_stage(client) as svc:

        async def unreachable(address, *args, **kwargs):
            raise OSError(f"no route to {address}")

        monkeypatch.setattr(futures_module, "open_comm", unreachable)
        xs = frames(3)
        for x, ref in zip(xs, reference(xs)):
            torch.testing.assert_close(svc.submit("tiny", x).result(timeout=30), ref, atol=1e-4, rtol=1e-4)
        assert reply_streams_of(cluster, client) == 0
        assert svc.status()["tiny"]["completed"] == 3


def test_a_resolution_that_comes_after_the_request_ended_leaves_it_as_it_ended(emulated_inproc):
    """A worker that stalled may still compute a request the scheduler dropped meanwhile: its late
    resolution does not turn the dropped request into a result."""
    from daskpipe.runtime.client.service import open_stream
    from daskpipe.runtime.tensors import pack_tensor

    _, client = emulated_inproc
    stream = open_stream(client)
    try:
        future = stream.pending["ended-early"] = ServedFuture("ended-early", client)
        client.futures["ended-early"].set_error(RequestDropped("late", "", "tiny", "ended-early"), None)
        stream.resolve(["ended-early"], [pack_tensor(torch.zeros(2))])
        assert future.status == "error"
        with pytest.raises(RequestDropped):
            future.result(timeout=5)
    finally:
        client.sync(stream.close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_inputs_travel_as_raw_bytes_and_rebuild_into_the_batch(dtype):
    from daskpipe.runtime.client.service import encode_input
    from daskpipe.runtime.worker.stage import decode_inputs

    xs = [(torch.randn(n, 4, 3) * 10).to(dtype) for n in (1, 3, 2)]
    xs[1] = xs[1].transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous
    payloads = [encode_input(x) for x in xs]
    assert all(type(p) is bytes for p in payloads)  # msgpack bin: nothing for the scheduler to unpickle
    assert torch.equal(decode_inputs(payloads, dtype, (4, 3)), torch.cat(xs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.complex64])
def test_the_client_check_sees_nonfinite_values_in_any_layout_and_encodes_the_values(dtype):
    """numpy where it can (no torch op per request), torch for what numpy lacks (bfloat16) or cannot
    view (a lazily conjugated tensor); a tensor that requires grad is read as its values."""
    from daskpipe.runtime.client.service import InputSpec, encode_input

    spec = InputSpec(shape=(4, 3), dtype=dtype, max_samples=4)
    good = torch.randn(2, 3, 4).to(dtype).transpose(1, 2)  # not contiguous
    variants = [good, good.detach().clone().requires_grad_(True)] + ([good.conj()] if dtype.is_complex else [])
    for x in variants:
        size, payload = spec.admit("m", x)
        assert size == 2 and payload == encode_input(x.detach().resolve_conj().contiguous())
    bad = good.clone()
    bad[1, 2, 0] = float("nan")
    with pytest.raises(InvalidRequest, match="NaN or Inf"):
        spec.admit("m", bad)
    assert InputSpec(shape=(4, 3), dtype=dtype, max_samples=4, allow_nonfinite=True).admit("m", bad)[0] == 2


def test_bad_inputs_err_at_once_and_the_service_keeps_serving(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        bad = {
            "unknown model": svc.submit("nope", frames(1)[0]),
            "non-tensor": svc.submit("tiny", np.zeros((1, *INPUT), dtype=np.float32)),
            "wrong shape": svc.submit("tiny", torch.randn(1, 3, 8, 8)),
            "wrong dtype": svc.submit("tiny", torch.randn(1, *INPUT, dtype=torch.float64)),
            "too many samples": svc.submit("tiny", torch.randn(5, *INPUT)),
        }
        good = svc.submit("tiny", frames(1)[0])
        for what, future in bad.items():
            assert future.done(), what  # erred at once, on the client
            with pytest.raises(InvalidRequest):
                future.result()
        assert "unknown model 'nope'" in str(bad["unknown model"].exception())
        assert "shape (n, 3, 16, 16)" in str(bad["wrong shape"].exception())
        assert "torch.float32" in str(bad["wrong dtype"].exception())
        torch.testing.assert_close(good.result(timeout=30), reference(frames(1))[0], atol=1e-4, rtol=1e-4)


class _Unreadable(torch.Tensor):
    """A tensor subclass that keeps its values to itself, as a user's odd subclass might."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.numpy, torch.isfinite):
            raise RuntimeError("this subclass cannot do that")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.randn(2, 3).to_sparse(), "must be a dense tensor, got layout torch.sparse_coo; send x.to_dense()"),
        (lambda: torch.randn(2, 3).to_sparse_csr(), "must be a dense tensor, got layout torch.sparse_csr"),
        (lambda: torch.randn(2, 3).to_mkldnn(), "must be a dense tensor, got layout torch._mkldnn"),
        (lambda: torch.empty(2, 3, device="meta"), "is on the meta device and holds no values"),
        (
            lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(2)]),
            "is a nested tensor; send each of its tensors as a request of its own",
        ),
        (lambda: torch.randn(2, 3, dtype=torch.complex64), "must be torch.float32, got torch.complex64"),
        (lambda: torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.qint8), "must be torch.float32, got torch.qint8"),
        (lambda: torch.tensor(1.0), r"must have shape \(n, 3\) with n >= 1, got \(\)"),
        (lambda: torch.randn(0, 3), r"must have shape \(n, 3\) with n >= 1, got \(0, 3\)"),
        (lambda: [[1.0, 2.0, 3.0]], r"must be a torch.Tensor of shape \(n, 3\), got list"),
        (lambda: np.zeros((1, 3), dtype=np.float32), "must be a torch.Tensor of shape .*, got ndarray"),
        (lambda: None, "must be a torch.Tensor .*, got NoneType"),
        (
            lambda: torch.randn(2, 3).as_subclass(_Unreadable),
            "cannot be read as a dense tensor of values: RuntimeError: this subclass cannot do that",
        ),
    ],
)
def test_an_input_torch_cannot_serve_is_refused_naming_the_problem(make, message):
    from daskpipe.runtime.client.service import InputSpec

    with pytest.raises(InvalidRequest, match=f"input of model 'm' {message}"):
        InputSpec(shape=(3,), dtype=torch.float32, max_samples=4).admit("m", make())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, requires_grad=True),
        lambda: torch.nn.Parameter(torch.randn(2, 3)),
        lambda: torch.randn(3, 2).t(),  # not contiguous
        lambda: torch.randn(1, 3).expand(2, 3),  # a stride of 0
        lambda: torch.randn(2, 6)[:, ::2],
    ],
)
def test_dense_tensors_in_any_layout_or_with_grad_are_served_as_their_values(make):
    from daskpipe.runtime.client.service import InputSpec

    x = make()
    assert InputSpec(shape=(3,), dtype=torch.float32, max_samples=4).admit("m", x) == (2, x.detach().contiguous().numpy().tobytes())


def test_any_input_ends_as_a_future_and_map_sends_all_of_its_inputs_or_none(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        for x, message in [
            (torch.randn(1, *INPUT).to_sparse(), "dense tensor"),
            (torch.empty(1, *INPUT, device="meta"), "meta device"),
            (torch.nested.nested_tensor([torch.randn(*INPUT)]), "nested tensor"),
        ]:
            future = svc.submit("tiny", x)
            assert future.done()
            with pytest.raises(InvalidRequest, match=message):
                future.result()
        before = svc.status()["tiny"]["submitted"]
        xs = frames(300)  # more than one SUBMIT_CHUNK: nothing may leave before the last input is checked
        futures = svc.map("tiny", xs[:280] + [torch.empty(1, *INPUT, device="meta")] + xs[280:])
        assert len(futures) == 301 and all(f.done() for f in futures)
        assert "meta device" in str(futures[280].exception())
        unsent = futures[0].exception()
        assert isinstance(unsent, InvalidRequest) and "not sent: map() sends all of its inputs or none, and 1 of its 301 inputs" in str(
            unsent
        )
        assert "(input 280)" in str(unsent) and all(str(f.exception()) == str(unsent) for f in futures[:280] + futures[281:])
        assert svc.status()["tiny"]["submitted"] == before  # nothing reached the scheduler
        for out, ref in zip(client.gather(svc.map("tiny", xs[:4])), reference(xs[:4])):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"models": {"tiny": lambda x: x}},
            "models['tiny'] must be a torch.nn.Module, got function; wrap it in an nn.Module whose forward calls it",
        ),
        ({"models": tiny_model()}, "models must map model names to torch.nn.Module, e.g. {'resnet': model}, got TinyCNN"),
        ({"models": {}}, "deploy needs at least one model"),
        ({"models": {3: tiny_model()}}, "model names must be non-empty strings, got [3]"),
        ({"example_inputs": {}}, "example_inputs lacks ['tiny']"),
        (
            {"example_inputs": {"tiny": [[0.0]]}},
            "example_inputs['tiny'] must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got list",
        ),
        (
            {"example_inputs": {"tiny": torch.empty(1, *INPUT, device="meta")}},
            "example_inputs['tiny'] must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got a meta tensor "
            "(it holds no values)",
        ),
        (
            {"example_inputs": {"tiny": torch.randn(1, *INPUT).to_sparse()}},
            "example_inputs['tiny'] must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got a tensor of "
            "layout torch.sparse_coo",
        ),
        (
            {"example_inputs": {"tiny": torch.tensor(1.0)}},
            "example_inputs['tiny'] must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got a tensor of "
            "shape ()",
        ),
        ({"slo_ms": {"tiny": "500"}}, "slo_ms['tiny'] must be a number of ms, got '500' (str)"),
        ({"slo_ms": {"tiny": -5}}, "slo_ms['tiny'] must be a finite number > 0 ms, got -5 ms"),
        ({"slo_ms": {"tiny": 0.0}}, "slo_ms['tiny'] must be a finite number > 0 ms, got 0.0 ms"),
        ({"slo_ms": {"tiny": float("nan")}}, "slo_ms['tiny'] must be a finite number > 0 ms, got nan ms"),
        ({"slo_ms": {"other": 500}}, "slo_ms names 'other', which is not a deployed model; deployed: ['tiny']"),
        ({"slo_ms": 500}, "slo_ms must map model names to values, got int"),
        ({"weights": {"tiny": -1}}, "weights['tiny'] must be a finite number > 0, got -1"),
        ({"time_dilation": "2"}, "time_dilation must be a number, got '2' (str)"),
        ({"time_dilation": 0}, "time_dilation must be a finite number > 0, got 0"),
        ({"planner": {"margin": 0.2}}, "planner must be a PlannerOptions, e.g. PlannerOptions(), got dict"),
        ({"profiling": None}, "profiling must be a ProfilingOptions, e.g. ProfilingOptions(), got NoneType"),
        ({"dispatcher": 1}, "dispatcher must be a name (str), got 1"),
        ({"allow_nonfinite": "yes"}, "allow_nonfinite must be True or False, got 'yes'"),
        ({"plan": 42}, "plan must be a Plan or the path of a plan.json, got int"),
        (
            {"profiles": {"tiny": {"model": "tiny"}}},
            "profiles['tiny'] must be a daskpipe Profile (Profile.load reads a profile file), got dict",
        ),
        ({"max_queued": 0}, "max_queued (None for the default) must be an integer >= 1, got 0"),
        ({"elastic": True}, "elastic must be an ElasticSettings or None, got bool"),
    ],
)
def test_deploy_names_the_argument_that_is_wrong(cpu_cluster, arguments, message):
    cluster, client = cpu_cluster
    given = {"models": {"tiny": tiny_model()}, "example_inputs": {"tiny": example()}, **arguments}
    with pytest.raises(DeployError, match="^" + re.escape(message)):
        daskpipe.deploy(client, given.pop("models"), **given)


class RefusesRandomInputs(torch.nn.Module):
    """Asserts on its input's values (``torch._assert``), which neither the meta device (no values)
    nor a random input passes: the estimator cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.abs().max() < 1e-6, "expects zeros")
        return self.conv(x)


def test_deploy_reports_data_dependent_control_flow_and_failed_deploys_release_what_they_made(emulated_inproc):
    """Estimating a model for the emulated GPU types runs it on the meta device, then on a random
    input; one that asserts on its values fails both. The profiling before made a scattered
    model and a task; a deploy that fails at the scheduler (an SLO it cannot meet) made stage
    actors and their scattered blocks. A failed deploy leaves none of them behind."""
    cluster, client = emulated_inproc

    def held() -> tuple[int, int]:
        return len(cluster.scheduler.tasks), len(client.futures)

    def settled(expected: tuple[int, int]) -> tuple[int, int]:
        """What is held once the releases reached the scheduler (on the client's loop), or after 5 s."""
        with contextlib.suppress(AssertionError):
            wait_until(lambda: held()[0] <= expected[0] and held()[1] <= expected[1], timeout=5, what="the releases")
        return held()

    before = held()
    after_each = []
    for _ in range(3):
        with pytest.raises(
            DeployError,
            match=r"^model 'zeros' cannot be profiled: .*Tensor.item\(\) cannot be called on meta tensors.*expects zeros.*This is "
            r"data-dependent control flow: .*Move such checks out of forward",
        ):
            daskpipe.deploy(
                client,
                {"zeros": RefusesRandomInputs()},
                example_inputs={"zeros": torch.zeros(1, *INPUT)},
                slo_ms={"zeros": 500.0},
                profiling=ProfilingOptions(num_blocks=2),
            )
        tasks, futures = settled(before)
        assert (
            tasks <= before[0] and futures <= before[1]
        )  # the scattered model and the profiling task are gone (earlier tests' keys may go meanwhile)
        with pytest.raises(DeployError, match="the smallest SLO it can serve"):
            deploy_two_stage(client, stage_ms=(40.0, 40.0), slo_ms=30.0)
        after_each.append(settled(before))
    # Each failed deploy made two stage actors and their blocks. Now and then one stage key of the
    # latest one is still counted by the client when this looks (an actor handle's reference, on
    # this in-process cluster); none accumulate.
    assert all(tasks <= before[0] + 1 and futures <= before[1] + 1 for tasks, futures in after_each), after_each


def test_a_poisoned_input_fails_alone_and_its_batch_mates_complete(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client) as svc:
        xs = frames(8)
        batch = svc.map("tiny", xs[:3] + [xs[3] * 1e6])  # one batch of four; stage 2 asserts on the last
        wait(batch, timeout=30)
        exc = batch[3].exception()
        assert isinstance(exc, RequestFailed), exc
        assert "stage 1 of model 'tiny'" in str(exc) and "poisoned input" in str(exc)
        assert isinstance(exc.cause, AssertionError)
        for out, ref in zip(client.gather(batch[:3]), reference(xs[:3])):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        status = svc.status()["tiny"]
        assert status["failed"] == 1 and status["completed"] == 3
        assert 2 <= status["isolated"] <= 4  # halves, then the poisoned half's halves: log2 of the batch
        healthy = svc.map("tiny", xs[4:])
        for out, ref in zip(client.gather(healthy), reference(xs[4:])):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_poison_isolation_is_bounded_by_its_budget(emulated_inproc):
    cluster, client = emulated_inproc
    with dask.config.set({"daskpipe.gray.isolation-burst": 0, "daskpipe.gray.isolation-share": 1e-9}), deploy_two_stage(client) as svc:
        xs = frames(4)
        batch = svc.map("tiny", xs[:3] + [xs[3] * 1e6])
        wait(batch, timeout=30)
        assert all(isinstance(f.exception(), RequestFailed) for f in batch), [
            f.exception() for f in batch
        ]  # no retry left: the batch fails whole, with the cause
        assert svc.status()["tiny"].get("isolated", 0) == 0


def test_a_bad_gray_failure_knob_fails_the_deploy_naming_it(emulated_inproc):
    cluster, client = emulated_inproc
    with (
        dask.config.set({"daskpipe.gray.suspect-factor": -1}),
        pytest.raises(DeployError, match=r"the Dask config: daskpipe.gray.suspect-factor: -1 is less than or equal to the minimum of 0"),
    ):
        deploy_two_stage(client)


@pytest.mark.protocols("tcp")
def test_an_slo_no_lone_request_can_meet_is_refused_at_deploy_with_the_smallest_one(emulated_inproc):
    cluster, client = emulated_inproc
    with pytest.raises(DeployError, match=r"a lone request takes 80.0 ms .* the smallest SLO it can serve is (\d+\.\d) ms") as refused:
        deploy_two_stage(client, stage_ms=(40.0, 40.0), slo_ms=30.0)
    assert float(re.search(r"serve is (\d+\.\d) ms", str(refused.value)).group(1)) > 80.0
    assert "tiny" not in client.sync(client.scheduler.daskpipe_status)  # nothing left served: it deploys again
    with deploy_two_stage(client, stage_ms=(40.0, 40.0), slo_ms=200.0) as svc:
        assert svc.submit("tiny", frames(1)[0]).result(timeout=30).shape == reference(frames(1))[0].shape


@pytest.mark.protocols("tcp")
def test_drops_err_with_the_reason(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client, stage_ms=(40.0, 40.0), slo_ms=120.0) as svc:  # a lone request fits; a burst of 12 cannot
        futures = svc.map("tiny", frames(12))
        wait(futures, timeout=30)
        dropped = [f.exception() for f in futures if f.status == "error"]
        assert dropped and all(isinstance(e, RequestDropped) and e.reason == "deadline" for e in dropped)
        assert svc.status()["tiny"]["dropped"] == {"deadline": len(dropped)}
        assert sum(f.status == "finished" for f in futures) == 12 - len(dropped)

    svc = deploy_two_stage(client, slo_ms=20_000.0, dispatcher=PAPER_PPIPE)  # a partial batch waits for its last moment
    queued = svc.map("tiny", frames(2))
    svc.close()
    for future in queued:
        with pytest.raises(RequestDropped, match=r"\(shutdown\)"):
            future.result(timeout=30)
    with pytest.raises(InvalidRequest, match="closed"):
        svc.submit("tiny", frames(1)[0]).result()


def test_a_deploy_in_real_time_serves_a_50ms_slo_at_half_load():
    """No time dilation: 4 + 6 ms stages (17.5 ms at the planned batch of 4) under a 50 ms SLO, the
    control path measured and planned for, at half the plan's capacity."""
    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    settle_heap()  # and this module's earlier tests'
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        with deploy_two_stage(client, slo_ms=50.0) as svc:
            wait(svc.map("tiny", frames(30, seed=2)), timeout=60)  # warm, and the margin measured
            before = svc.status()["tiny"]
            xs = frames(300)
            inputs = iter(xs)
            futures = paced(lambda: svc.submit("tiny", next(inputs)), 0.5 * svc.plan.model("tiny").throughput, count=len(xs))
            wait(futures, timeout=60)
            after = svc.status()["tiny"]
            submitted, on_time = (after[c] - before[c] for c in ("submitted", "on_time"))
            assert submitted == len(xs) and on_time / submitted >= 0.99, (
                after["dropped"],
                {k: round(v, 2) for k, v in after["control"].items()},
            )
            control = after["control"]
            assert 0 < control["done_worker_p50_ms"] and 0 < control["done_wire_p50_ms"], control
            assert max(control["done_worker_p50_ms"], control["done_wire_p50_ms"]) <= control["done_p99_ms"], "parts of the way back"
        assert all(client.run(gc.get_freeze_count).values()), "each stage worker froze its heap once set up"


def test_processes_cluster_at_load_factor_0_7_meets_99_percent_attainment():
    serve_at_load_factor("tcp", k=20.0)


@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("distributed_ucxx") is None, reason="distributed-ucxx is not installed")
def test_processes_cluster_over_ucx():
    # UCX's progress threads poll: on a 2-core machine they take CPU from the stages, so time is dilated more.
    serve_at_load_factor("ucx", k=40.0)


def test_an_asynchronous_client_deploys_submits_reads_the_plan_and_closes(emulated_inproc):
    import asyncio

    from distributed import Client

    cluster, _ = emulated_inproc
    profile, plan = two_stage()
    xs = frames(3)

    async def serve() -> None:
        async with Client(cluster.scheduler_address, asynchronous=True, security=cluster.security) as client:
            svc = await daskpipe.deploy(
                client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}
            )
            async with svc:
                outputs = [await svc.submit("tiny", x) for x in xs]
                for out, ref in zip(outputs, reference(xs)):
                    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
                assert (await svc.plan).model("tiny").pipelines[0].batch_size == 4

                async def counted() -> (
                    bool
                ):  # the last stage's worker resolves the futures; the scheduler counts them when its completion follows
                    return (await svc.status())["tiny"]["completed"] == 3

                await wait_until_async(counted, timeout=10, what="the scheduler to count the requests")
                with pytest.raises(RuntimeError, match="blocks its caller's thread"):
                    svc.as_completed()
            assert svc.closed and (await client.scheduler.daskpipe_status(models=["tiny"])) == {}

    asyncio.run(serve())


def test_deploy_with_a_second_client_in_the_process_starts_at_once_and_serves():
    """A monitoring client opened after the deploying one is the process's default client, the
    one Dask's ``wait`` goes through: the deploy waits on its own client all the same."""
    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    xs = frames(3)
    with (
        EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster,
        Client(cluster) as client,
        Client(cluster.scheduler_address) as monitor,
    ):
        started = time.monotonic()
        with deploy_two_stage(client) as svc:
            assert time.monotonic() - started < 30
            outputs = [svc.submit("tiny", x).result(timeout=30) for x in xs]
            for out, ref in zip(outputs, reference(xs)):
                torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            assert len(monitor.scheduler_info()["workers"]) == 2


def test_deploy_while_another_processs_client_is_connected_serves_before_and_after_it_leaves():
    import subprocess
    import sys

    from distributed import Client

    from daskpipe.runtime.cluster import EmulatedCluster

    xs = frames(2)
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        alone = set(cluster.scheduler.clients)
        connect = f"from distributed import Client; c = Client({cluster.scheduler_address!r}); print('connected', flush=True); input()"
        with subprocess.Popen([sys.executable, "-c", connect], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as other:
            assert other.stdout is not None and other.stdout.readline() == "connected\n"
            started = time.monotonic()
            with deploy_two_stage(client) as svc:
                assert time.monotonic() - started < 30
                torch.testing.assert_close(svc.submit("tiny", xs[0]).result(timeout=30), reference(xs[:1])[0], atol=1e-4, rtol=1e-4)
                other.communicate("\n", timeout=30)
                wait_until(lambda: set(cluster.scheduler.clients) == alone, timeout=10, what="the other process's client to leave")
                torch.testing.assert_close(svc.submit("tiny", xs[1]).result(timeout=30), reference(xs[1:])[0], atol=1e-4, rtol=1e-4)
