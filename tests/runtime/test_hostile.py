"""Hostile input: malformed and non-finite requests, inputs that bypass the client's checks,
clients that release or abandon their requests, corrupt plan and profile files.

Every request must end as a result, a RequestDropped with its reason, or an error naming the
problem, and none may hurt the requests served beside it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import Client, Future, LocalCluster, wait
from distributed.protocol import to_serialize

import daskpipe
from daskpipe.plan.schema import PlanError
from daskpipe.profiles.loader import load_profiles
from daskpipe.profiles.model import Profile, ProfileError
from daskpipe.runtime.client.service import encode_input
from daskpipe.runtime.errors import DeployError, InvalidRequest, RequestDropped, RequestFailed
from daskpipe.runtime.scheduler.plugin import DaskpipeSchedulerPlugin, plugin_of
from tests.helpers import REPO, paced, settle_heap, wait_until
from tests.runtime.helpers import (
    INPUT,
    LARGE_INPUT,
    PAPER_PPIPE,
    counted,
    deploy_two_stage,
    example,
    frames,
    reference,
    request_outcomes,
    tiny_model,
    two_stage,
)

pytestmark = pytest.mark.timeout(180)


def send_raw(svc, model: str, inputs: list, sizes: list) -> list[Future]:
    """A client that skips the Service's checks: a key and future per size, and a SUBMIT message as it likes."""
    keys = [f"hostile-{uuid.uuid4().hex}" for _ in sizes]
    futures = [Future(key, svc.client) for key in keys]
    svc._send(model, keys, inputs, sizes)
    return futures


def test_nan_and_inf_inputs_err_at_once_unless_the_service_allows_them(emulated_inproc):
    cluster, client = emulated_inproc
    nan, inf = frames(2)
    nan[0, 0, 0, 0], inf[0, 1, 2, 3] = float("nan"), float("-inf")
    with deploy_two_stage(client) as svc:
        for x in (nan, inf):
            future = svc.submit("tiny", x)
            assert future.done()
            with pytest.raises(InvalidRequest, match="NaN or Inf.*allow_nonfinite=True"):
                future.result()
        xs = frames(4, seed=3)  # a full batch: it runs at once
        for out, ref in zip(client.gather(svc.map("tiny", xs)), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    profile, plan = two_stage()
    with daskpipe.deploy(
        client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=plan, profiles={"tiny": profile}, allow_nonfinite=True
    ) as svc:
        good = frames(3, seed=3)
        batch = svc.map("tiny", [nan, *good])  # served as asked: it reaches the model, which asserts on it
        with pytest.raises(RequestFailed, match="poisoned input"):
            batch[0].result(timeout=30)
        for out, ref in zip(client.gather(batch[1:]), reference(good)):  # its batch-mates, retried apart, complete
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [INPUT, LARGE_INPUT], ids=["inline", "frames"])
def test_the_scheduler_refuses_inputs_that_bypass_the_client_and_serves_the_rest(emulated_inproc, shape):
    cluster, client = emulated_inproc
    good = frames(4, shape=shape)
    raw = encode_input(good[0])
    before = request_outcomes(cluster.scheduler)
    with deploy_two_stage(client, input_shape=shape) as svc:
        cases = {
            "samples take": (raw[:-4], 1),  # truncated: would fail the whole batch it joined
            "1 to 4 samples": (raw * 5, 5),  # more than the largest planned batch
            "got 0": (b"", 0),
            "got '1'": (raw, "1"),
            "raw bytes, got str": ("not bytes", 1),
            "raw bytes, got a serialized numpy.ndarray": (to_serialize(np.zeros(len(raw) // 8)), 1),  # a frame, but not of bytes
        }
        valid = [encode_input(x) for x in good]  # a full batch beside the bad ones: it runs at once
        futures = send_raw(svc, "tiny", [c[0] for c in cases.values()] + valid, [c[1] for c in cases.values()] + [1] * len(valid))
        for (expected, _), future in zip(cases.items(), futures):
            with pytest.raises(InvalidRequest, match=f"refused by the scheduler.*{expected}"):
                future.result(timeout=30)
        for out, ref in zip(client.gather(futures[len(cases) :]), reference(good)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        for out, ref in zip(client.gather(svc.map("tiny", good)), reference(good)):  # and through the Service
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        (ragged,) = send_raw(svc, "tiny", [raw, raw], [1])
        with pytest.raises(InvalidRequest, match="1 keys and 2 inputs"):
            ragged.result(timeout=30)
        assert svc.status()["tiny"]["invalid"] == len(cases)
        counted = {outcome: total - before.get(outcome, 0) for outcome, total in request_outcomes(cluster.scheduler).items()}
        assert counted["invalid"] == len(cases) and counted["submitted"] == len(cases) + 2 * len(valid)
        assert counted["submitted"] == counted["completed"] + counted["failed"] + counted["invalid"] + counted["dropped"], (
            counted
        )  # every outcome accounted for


MALFORMED_FIELDS = {  # what the error says: the field, and what it was given
    "Expected `int`, got `object` - at `$.start_block`": {"start_block": {"a": 1}},
    "start_block must be an integer >= 0, got -1": {"start_block": -1},
    "Expected `array`, got `null` - at `$.inputs`": {"inputs": None},
    "Expected `array`, got `int` - at `$.sizes`": {"sizes": 3},
    "Expected `str`, got `int` - at `$.model`": {"model": 7},
    "Object contains unknown field `priority`": {"priority": "high"},
    "sent_at must be a finite wall-clock time": {"sent_at": float("nan")},
    "2 keys and 1 sizes": {"sizes": [1]},
}


@pytest.mark.parametrize("problem", list(MALFORMED_FIELDS))
def test_a_submission_with_a_malformed_field_errs_every_one_of_its_futures_at_once(emulated_inproc, problem):
    cluster, client = emulated_inproc
    raw = encode_input(frames(1)[0])
    with deploy_two_stage(client) as svc:
        keys = [f"hostile-{uuid.uuid4().hex}" for _ in range(2)]
        futures = [Future(key, client) for key in keys]
        message = {
            "op": "daskpipe-submit",
            "model": "tiny",
            "keys": keys,
            "inputs": [raw, raw],
            "sizes": [1, 1],
            **MALFORMED_FIELDS[problem],
        }
        svc._stream.send(message)
        for future in futures:
            with pytest.raises(InvalidRequest, match=f"malformed submission.*{re.escape(problem)}"):
                future.result(timeout=10)
        assert svc.submit("tiny", frames(1)[0]).result(timeout=30).shape == (1, 10)  # the stream still serves


FLOODS = {
    "nope": (RequestDropped, "no service serves this model"),  # refused whole
    "tiny": (InvalidRequest, "refused by the scheduler: 1 samples take"),  # refused request by request: no input
}


def flood_from_another_process(address: str, model: str, go, report) -> None:
    """A client of its own process sends one submission of 100 000 keys for ``model`` when ``go``
    is set, and reports when it sent it, when its first and its last key ended (monotonic clock,
    which the processes of one host share), and how the last one ended."""
    from daskpipe.runtime.client.futures import ClientStream

    with Client(address) as flooder:
        stream = ClientStream(flooder)
        flooder.sync(stream.open)
        keys = [f"flood-{i}" for i in range(100_000)]
        first, last = Future(keys[0], flooder), Future(keys[-1], flooder)
        report.put("ready")
        go.wait()
        sent = time.monotonic()
        stream.send({"op": "daskpipe-submit", "model": model, "keys": keys, "inputs": [b""] * len(keys), "sizes": [1] * len(keys)})
        first_ended = last_ended = None
        while last_ended is None and time.monotonic() < sent + 60:
            if first_ended is None and first.done():
                first_ended = time.monotonic()
            if last.done():
                last_ended = time.monotonic()
            time.sleep(0.002)
        ended = last.exception(timeout=1) if last_ended is not None else None
        report.put((sent, first_ended, last_ended, type(ended).__name__, str(ended)))
        flooder.sync(stream.close)


@pytest.mark.parametrize("flooded", list(FLOODS))
def test_one_100k_key_message_never_holds_the_scheduler_from_another_clients_100ms_slo(flooded):
    """The bar of #43: the other client's requests >= 99% on time at a 100 ms SLO, and the
    scheduler's loop never held over 50 ms of its thread's CPU (its wall-clock lag on a busy
    machine is mostly the time the thread waited for a core). The flooder is a client in another
    process, as a client of another user is: one in this process, where the scheduler runs too,
    encodes the message under the scheduler's interpreter lock (12-22 ms), which the watcher may
    see together with Dask's decoding of it (20-25 ms) in the next turn."""
    from distributed.utils import get_mp_context  # as Dask starts its workers: spawn unless configured

    from daskpipe.benchmarks.runtime_overhead import LoopLag
    from daskpipe.runtime.cluster import EmulatedCluster

    error, message = FLOODS[flooded]
    context = get_mp_context()
    go, report = context.Event(), context.Queue()
    settle_heap()  # and this module's earlier tests'
    with (
        EmulatedCluster({"L4": 1, "T4": 1}, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        flooder = context.Process(target=flood_from_another_process, args=(cluster.scheduler_address, flooded, go, report), daemon=True)
        flooder.start()
        try:
            assert report.get(timeout=60) == "ready"
            with deploy_two_stage(client, slo_ms=100.0) as svc:  # real time: 4 + 6 ms stages, no dilation
                wait(svc.map("tiny", frames(40, seed=2)), timeout=60)  # the control path measured
                before = counted(svc, "tiny", 40)
                lag = LoopLag(interval_s=0.001)
                cluster.sync(lag.start)
                valid, submitted_at = [], []
                for i, x in enumerate(frames(200)):  # 200 requests a second for a second, the flood sent in their midst
                    if i == 50:
                        go.set()
                    valid.append(svc.submit("tiny", x))
                    submitted_at.append(time.monotonic())
                    time.sleep(0.005)
                wait(valid, timeout=30)
                sent, first_ended, last_ended, ended_as, ended_with = report.get(timeout=90)
                cluster.sync(lag.stop)
                held = max(lag.held_cpu_s)
                after = counted(svc, "tiny", 40 + len(valid))
                assert ended_as == error.__name__ and re.search(message, ended_with), (ended_as, ended_with)
                assert first_ended is not None and any(first_ended <= t < last_ended for t in submitted_at), (
                    "the flood was not taken while the requests ran",
                    sent,
                    first_ended,
                    last_ended,
                    submitted_at[50],
                )
                on_time = after["on_time"] - before["on_time"]
                assert after["completed"] - before["completed"] == len(valid) and on_time >= 0.99 * len(valid), (after, len(valid))
                assert held <= 0.05, f"the scheduler's loop was held {held * 1e3:.1f} ms"
        finally:
            go.set()  # a test that failed before the flood lets the flooder end
            flooder.join(timeout=30)
            if flooder.is_alive():
                flooder.kill()


@pytest.mark.protocols("tcp")
def test_1000_malformed_requests_in_a_valid_stream_each_err_and_the_valid_ones_meet_the_slo(emulated_inproc):
    cluster, client = emulated_inproc
    k = 10.0
    raw = encode_input(frames(1)[0])
    client_side = [
        ("unknown model 'nope'", lambda: ("nope", frames(1)[0])),
        ("must be a torch.Tensor", lambda: ("tiny", np.zeros((1, *INPUT), dtype=np.float32))),
        ("must have shape", lambda: ("tiny", torch.randn(1, 3, 8, 8))),
        ("must have shape", lambda: ("tiny", torch.randn(0, *INPUT))),
        ("must be torch.float32", lambda: ("tiny", torch.randn(1, *INPUT, dtype=torch.float64))),
        ("at most 4 samples", lambda: ("tiny", torch.randn(5, *INPUT))),
        ("NaN or Inf", lambda: ("tiny", torch.full((1, *INPUT), float("inf")))),
    ]
    with deploy_two_stage(client, k=k) as svc:
        wait(svc.map("tiny", frames(8, seed=2)), timeout=60)
        before = svc.status()["tiny"]
        malformed: list[tuple[str, Future]] = []

        def mixed_in() -> None:  # 7 malformed requests after each valid one (1000 in all), every kind in turn
            for _ in range(7 if len(malformed) < 1000 - 7 else 1000 - len(malformed)):
                i = len(malformed)
                if i % 8 == 7:  # one in eight bypasses the client's checks
                    malformed.append(("samples take", send_raw(svc, "tiny", [raw[: -(i % 5 + 1)]], [1])[0]))
                else:
                    expected, make = client_side[i % len(client_side)]
                    malformed.append((expected, svc.submit(*make())))

        xs = frames(143)
        capacity = svc.plan.model("tiny").throughput / k
        inputs = iter(xs)

        def valid_then_malformed() -> Future:
            future = svc.submit("tiny", next(inputs))
            mixed_in()
            return future

        valid = paced(valid_then_malformed, 0.5 * capacity, count=len(xs))
        wait(valid + [f for _, f in malformed], timeout=60)
        assert len(malformed) == 1000
        for expected, future in malformed:
            assert future.status == "error", future
            assert isinstance(future.exception(), InvalidRequest) and expected in str(future.exception()), (expected, future.exception())
        for out, ref in zip(client.gather(valid), reference(xs)):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        after = svc.status()["tiny"]
        on_time, completed = (after[c] - before[c] for c in ("on_time", "completed"))
        assert completed == len(xs) and on_time / len(xs) >= 0.99, after
        assert after["invalid"] - before["invalid"] == sum(e == "samples take" for e, _ in malformed)


def test_requests_released_while_queued_are_dropped_not_computed(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client, slo_ms=20_000.0, dispatcher=PAPER_PPIPE) as svc:  # the paper's partial batch waits for its last moment
        abandoned = svc.map("tiny", frames(3))
        wait_until(lambda: svc.status()["tiny"]["queued"] == 3, timeout=30, what="3 queued")
        client.cancel(abandoned)  # Dask's cancel-keys goes on the client's batched stream: the next submit could overtake it
        wait_until(
            lambda: not any(f.key in cluster.scheduler.tasks for f in abandoned), timeout=30, what="the cancellation on the scheduler"
        )
        kept = svc.submit("tiny", frames(1)[0])  # fills the batch of 4: it runs now, alone
        torch.testing.assert_close(kept.result(timeout=30), reference(frames(1))[0], atol=1e-4, rtol=1e-4)
        status = svc.status()["tiny"]
        assert status["dropped"] == {"released": 3} and status["completed"] == 1 and status["queued"] == 0, status


def test_outputs_of_requests_released_mid_batch_are_freed_on_the_worker(emulated_inproc):
    cluster, client = emulated_inproc
    with deploy_two_stage(client, stage_ms=(300.0, 300.0), slo_ms=5_000.0) as svc:
        futures = svc.map("tiny", frames(4))  # one full batch, held 0.5 s per stage
        wait_until(lambda: svc.status()["tiny"]["in_flight"] == 4, timeout=30, what="the batch in flight")
        keys = [f.key for f in futures]
        client.cancel(futures)
        wait_until(lambda: svc.status()["tiny"]["completed"] == 4, timeout=30, what="the batch to end")
        workers = [w for w in cluster.workers.values()]
        wait_until(lambda: not any(key in w.data for w in workers for key in keys), timeout=30, what="the worker to free the outputs")
        assert not any(key in cluster.scheduler.tasks for key in keys)


VANISHING = """
import sys, time
from distributed import Client
import daskpipe
from tests.runtime.helpers import example, tiny_model, two_stage
client = Client(sys.argv[1])
profile, plan = two_stage("vanishing", slo_ms=60_000.0, gpus=("cpu", "cpu"))
svc = daskpipe.deploy(
    client, {"vanishing": tiny_model()}, example_inputs={"vanishing": example()}, plan=plan, profiles={"vanishing": profile}
)
futures = svc.map("vanishing", [example() for _ in range(3)])  # a partial batch: it waits a minute
print("submitted", flush=True)
time.sleep(120)
"""


def test_a_client_killed_mid_stream_leaves_nothing_behind():
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp", dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(DaskpipeSchedulerPlugin())
        vanish_and_redeploy(cluster, client)


def vanish_and_redeploy(cluster, client) -> None:
    """A client process that deployed a model and queued requests is killed; another takes the name."""
    plugin = plugin_of(cluster.scheduler)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", VANISHING, cluster.scheduler_address], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "submitted"
        wait_until(
            lambda: "vanishing" in plugin.models.ledgers and len(plugin.models.ledgers["vanishing"].queued) == 3,
            timeout=30,
            what="its requests queued",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ledger = plugin.models.ledgers["vanishing"]
    wait_until(lambda: ledger.closing, timeout=30, what="its model closed")
    assert ledger.queued == {} and ledger.dropped == {"client-gone": 3} and ledger.counts["batches"] == 0
    wait_until(lambda: not any("vanishing" in str(key) for key in cluster.scheduler.tasks), timeout=30, what="its keys forgotten")
    profile, plan = two_stage("vanishing", gpus=("cpu", "cpu"))  # the name is free again
    with daskpipe.deploy(
        client, {"vanishing": tiny_model()}, example_inputs={"vanishing": example()}, plan=plan, profiles={"vanishing": profile}
    ) as svc:
        for out, ref in zip(client.gather(svc.map("vanishing", frames(4))), reference(frames(4))):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def corrupt(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


PLAN_CORRUPTIONS = {
    "not valid JSON": lambda d: '{"models": [',
    "not JSON text": lambda d: b"\xff\xfe\x00\x01binary",
    "top level must be a JSON object": lambda d: "[1, 2]",
    "field models must be a list": lambda d: json.dumps({**d, "models": 7}),
    "pipelines\\[0\\].batch_size must be an integer": lambda d: json.dumps(d).replace('"batch_size": 4', '"batch_size": "four"'),
    "field cluster must be an object": lambda d: json.dumps({**d, "cluster": [1]}),
}


@pytest.mark.parametrize("problem", list(PLAN_CORRUPTIONS))
def test_a_corrupt_plan_file_fails_deploy_naming_the_file_and_the_problem(cpu_cluster, tmp_path, problem):
    cluster, client = cpu_cluster
    profile, plan = two_stage(gpus=("cpu", "cpu"))
    path = corrupt(tmp_path / "plan.json", PLAN_CORRUPTIONS[problem](plan.to_dict()))
    with pytest.raises(PlanError, match=f"{path}: .*{problem}"):
        daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=path, profiles={"tiny": profile})


def test_a_plan_file_for_other_models_or_blocks_fails_deploy_naming_the_file(cpu_cluster, tmp_path):
    cluster, client = cpu_cluster
    profile, plan = two_stage(gpus=("cpu", "cpu"))
    other = tmp_path / "other.json"
    two_stage("other", gpus=("cpu", "cpu"))[1].save(other)
    with pytest.raises(DeployError, match=f"plan {other} has no model \\['tiny'\\]"):
        daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=other, profiles={"tiny": profile})
    deeper = plan.to_dict()
    deeper["models"][0]["pipelines"][0]["partitions"][1]["blocks"] = [1, 3]
    path = corrupt(tmp_path / "deeper.json", json.dumps(deeper))
    with pytest.raises(DeployError, match=f"plan {path} cuts 'tiny' up to block 3, its profile has 2 blocks"):
        daskpipe.deploy(client, {"tiny": tiny_model()}, example_inputs={"tiny": example()}, plan=path, profiles={"tiny": profile})


PROFILE_CORRUPTIONS = {
    "not valid JSON": lambda d: "{",
    "not JSON text": lambda d: b"\x00\xff garbage",
    "missing field 'latency_us'": lambda d: json.dumps({k: v for k, v in d.items() if k != "latency_us"}),
    "ragged table": lambda d: json.dumps({**d, "latency_us": {"L4": {"1": [[1, 2], [3]]}}}),
    "'input_shape': expected a shape of positive integers": lambda d: json.dumps({**d, "input_shape": [3, "x", 16]}),
    "'boundary_shapes': expected a list": lambda d: json.dumps({**d, "boundary_shapes": 8}),
    "'meta': expected an object": lambda d: json.dumps({**d, "meta": [1]}),
}


@pytest.mark.parametrize("problem", list(PROFILE_CORRUPTIONS))
def test_a_corrupt_profile_file_fails_naming_the_file_and_the_problem(tmp_path, problem):
    profile, _ = two_stage()
    path = corrupt(tmp_path / "tiny.json", PROFILE_CORRUPTIONS[problem](profile.to_dict()))
    for load in (Profile.load, lambda file: load_profiles(file.parent)):
        with pytest.raises(ProfileError, match=f"{path}: .*{problem}"):
            load(path)
