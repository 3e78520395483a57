"""Graft plans on daskpipe's runtime: fragments entering one model at blocks 0, 1 and 2 share one stage.

An emulated cluster (four 1/2 V100 slots in this process) serves a hand-made Graft plan: private
stages [0, 2) and [1, 2), and the shared stage [2, 4) that requests entering at block 2 reach
directly. Its emulated latency is long, so batches from both private stages queue behind a batch
entering at block 2 and run merged. A last test deploys what Graft's planner itself makes.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from distributed import Client, Future, wait

from daskpipe.graft import Fragment, StageCosts, plan_graft
from daskpipe.profiles.estimator import estimate_profile
from daskpipe.runtime.client.hybrid import SharedStage, deploy_hybrid, hybrid_plan
from daskpipe.runtime.client.service import encode_input
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.deploying.deployment import pickle_blocks
from daskpipe.runtime.errors import DeployError, InvalidRequest
from daskpipe.runtime.scheduler.plugin import plugin_of
from tests.graft.helpers import BUDGET_MS, serving_plan


def test_plan_has_a_pipeline_per_entry_and_one_shared_pool(model_and_profile) -> None:
    _, _, profile = model_and_profile
    serving, fragments = serving_plan()
    hybrid = hybrid_plan(serving, fragments, profile, offered_slices=[2])
    pipelines = hybrid.plan.model("tiny").pipelines
    assert sorted(p.entry_block for p in pipelines) == [0, 1, 2]
    assert all(p.partitions[-1].blocks == (2, 4) and p.slo_us == BUDGET_MS * 1e3 for p in pipelines)
    assert len(hybrid.shared) == 1 and all(hybrid.stage_of[(p, len(pl.partitions) - 1)] in hybrid.shared for p, pl in enumerate(pipelines))
    assert set(hybrid.slices.values()) == {2}  # Graft's 40% and 50% shares fit a 1/2 slice


def test_three_entries_through_one_shared_stage(model_and_profile) -> None:
    module, blocked, profile = model_and_profile
    serving, fragments = serving_plan()
    torch.manual_seed(1)
    images = {k: torch.randn(8 if k == 2 else 2, 3, 16, 16) for k in (0, 1, 2)}
    with torch.inference_mode():
        expected = {k: module(x) for k, x in images.items()}
        entering = {k: (blocked.run(x, end=k).half() if k else x) for k, x in images.items()}
    with EmulatedCluster({"V100": 2}, slices=2, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        svc = deploy_hybrid(client, module, serving=serving, fragments=fragments, profile=profile, example_input=images[0][:1])
        with svc:
            # block 2's full batch takes the shared slot first; the private stages' batches queue behind it
            futures = {2: svc.map("tiny", entering[2].split(2), start_block=2)}
            futures[0] = svc.map("tiny", entering[0].split(1), start_block=0)
            wrong_shape = svc.submit("tiny", entering[0][:1].half(), start_block=1)
            wrong_dtype = svc.submit("tiny", entering[1][:1].float(), start_block=1)
            no_entry = svc.submit("tiny", entering[2][:1], start_block=3)
            futures[1] = svc.map("tiny", entering[1].split(1), start_block=1)
            for bad, message in ((wrong_shape, "block 1"), (wrong_dtype, "torch.float16"), (no_entry, "entries at blocks \\[0, 1, 2\\]")):
                assert bad.status == "error"  # at once, on the client
                with pytest.raises(InvalidRequest, match=message):
                    bad.result()
            wait([f for fs in futures.values() for f in fs], timeout=60)
            for k, fs in futures.items():
                torch.testing.assert_close(torch.cat(client.gather(fs)), expected[k], rtol=1e-2, atol=1e-2)
            ledger = plugin_of(cluster.scheduler).models.ledgers["tiny"]
            stage_tasks = [pickle.dumps(cluster.scheduler.tasks[key].run_spec) for key in set(ledger.stages.values())]
            assert max(map(len, stage_tasks)) < min(map(len, pickle_blocks(blocked.blocks)))  # blocks travel scattered, once
            dispatcher = ledger.dispatcher
            shared = [a for w in cluster.workers.values() for a in w.state.actors.values() if isinstance(a, SharedStage)]
            assert len(shared) == 1
            merged = [call for call in shared[0].info()["recent"] if len({dispatcher.entry_of(d) for d in call["dispatches"]}) > 1]
            assert merged and shared[0].merged_calls == len(merged)  # compute calls that mixed batches of different fragments
            for call in merged:  # held for the merged batch's profiled latency, not for its parts' in turn
                in_turn = sum(profile.latency("V100", 2, n, 2, 4) for n in call["samples"]) * 1e-6
                assert profile.latency("V100", 2, sum(call["samples"]), 2, 4) * 1e-6 <= call["held_s"] + 1e-3 < in_turn
            status = svc.status()["tiny"]
            assert status["completed"] == 8 and status["on_time"] == 8 and not status["dropped"]
            stray = Future("stray-entry", client)  # a client that skips the Service's check
            svc._send("tiny", ["stray-entry"], [encode_input(entering[2][:1])], [1], start_block=3)
            with pytest.raises(InvalidRequest, match=r"no requests entering at block 3; its plan has entries at \[0, 1, 2\]"):
                stray.result(timeout=30)


def test_graft_planner_output_serves_every_entry(model_and_profile) -> None:
    """The planner's own plan for an estimated profile deploys as is (time-dilated for the CPU)."""
    module, blocked, _ = model_and_profile
    profile = estimate_profile(blocked, gpus=["V100"], name="tiny", batch_sizes=4, slices=(1, 2))
    fragments = [Fragment("tiny", k, 2.0, 200.0, (f"dev{k}",)) for k in (0, 1, 2)]
    serving = plan_graft(StageCosts(profile, "V100"), fragments).serving()
    assert any(len(route) == 2 for route in serving.routes.values())  # some fragment is re-aligned onto a shared stage
    torch.manual_seed(2)
    images = {k: torch.randn(1, 3, 16, 16) for k in (0, 1, 2)}
    with EmulatedCluster({"V100": 2}, slices=2, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        with deploy_hybrid(
            client, module, serving=serving, fragments=fragments, profile=profile, example_input=images[0], time_dilation=1000.0
        ) as svc:
            with torch.inference_mode():
                futures = {k: svc.submit("tiny", blocked.run(x, end=k).half() if k else x, start_block=k) for k, x in images.items()}
                for k, future in futures.items():
                    torch.testing.assert_close(future.result(timeout=60), module(images[k]), rtol=1e-2, atol=1e-2)
            assert svc.status()["tiny"]["completed"] == 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"module": lambda x: x}, "module must be a torch.nn.Module, got function; wrap it in an nn.Module whose forward calls it"),
        ({"serving": "plan.json"}, "serving must be a graft ServingPlan, got str"),
        ({"fragments": [1]}, "fragments must be a sequence of graft Fragments, got list"),
        ({"profile": {}}, "profile must be a daskpipe Profile (Profile.load reads a profile file), got dict"),
        (
            {"example_input": torch.empty(1, 3, 16, 16, device="meta")},
            "example_input must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got a meta tensor (it "
            "holds no values)",
        ),
        ({"time_dilation": "2"}, "time_dilation must be a number, got '2' (str)"),
        ({"bw_gbps": 0}, "bw_gbps must be a finite number > 0 Gbit/s, got 0 Gbit/s"),
    ],
)
def test_deploy_hybrid_names_the_argument_that_is_wrong(model_and_profile, arguments, message) -> None:
    module, _, profile = model_and_profile
    serving, fragments = serving_plan()
    given = {
        "module": module,
        "serving": serving,
        "fragments": fragments,
        "profile": profile,
        "example_input": torch.zeros(1, 3, 16, 16),
        **arguments,
    }
    with Client(processes=False, n_workers=0, dashboard_address=None) as client, pytest.raises(DeployError, match="^" + re.escape(message)):
        deploy_hybrid(client, given.pop("module"), **given)
