"""Stage actors started one way for every plan (daskpipe/runtime/deploying/deployment.py): a model's blocks
travel once, as scattered data, and a start is all or nothing.

A two-block model whose first block holds 1 MB of weights runs on an emulated L4 and T4 slot in
this process; the stages are described by hand, as a plan's placement would describe them.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import replace

import pytest
import torch
from distributed import Client
from distributed.utils_test import poll_for
from torch import nn

from daskpipe.profiles.fx import BlockedModel, segment_model
from daskpipe.runtime.client.service import inventory
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.deploying.deployment import WORKER_CHECK_S, StageLaunch, pickle_blocks, ppipe_launches, release, start_stages
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.worker.stage import FEATURE_MAP_DTYPE, Stage, feature_map_peers
from tests.runtime.helpers import BATCH, two_stage


@pytest.fixture(scope="module")
def cluster_and_model():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).eval()
    segmented = segment_model(module, torch.zeros(1, 256))
    blocked = segmented.cut([0, 1, segmented.num_segments])
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as cluster, Client(cluster) as client:
        yield cluster, client, blocked


def launches(client: Client, blocked: BlockedModel, second_input: tuple[int, ...] | None = None) -> list[StageLaunch]:
    """Block 0 on one slot feeding block 1 on the other (``second_input``: what block 1 is told it takes)."""
    shapes = [tuple(blocked.input_shape), second_input or tuple(blocked.boundary_shapes[0])]
    return [
        StageLaunch("m", q, (q, q + 1), slot, shapes[q], "float32", Stage, (0, q), ((0, 1),) if q == 0 else (), ((0, q),))
        for q, slot in enumerate(inventory(client))
    ]


def test_stage_tasks_carry_no_weights_and_the_scattered_blocks_go_once_the_stages_hold_them(cluster_and_model) -> None:
    cluster, client, blocked = cluster_and_model
    blocks = pickle_blocks(blocked.blocks)
    before = set(cluster.scheduler.tasks)
    started = client.sync(start_stages, client, launches(client, blocked), {"m": blocks})
    keys = [key for _, _, _, key in started.rows["m"]]
    assert [row[:3] for row in started.rows["m"]] == [[0, q, launch.slot.address] for q, launch in enumerate(launches(client, blocked))]
    assert max(len(pickle.dumps(cluster.scheduler.tasks[key].run_spec)) for key in keys) < len(blocks[0]) / 100  # 1 MB of weights
    poll_for(lambda: set(cluster.scheduler.tasks) - before == set(keys), timeout=5)
    workers = {worker.address: worker for worker in cluster.workers.values()}
    (_, _, first, _), (_, _, second, _) = started.rows["m"]
    assert feature_map_peers(workers[first]) == [second] and feature_map_peers(workers[second]) == []  # block 0 streams to block 1
    release(started.futures)
    poll_for(lambda: set(cluster.scheduler.tasks) <= before, timeout=5)


def test_a_stage_that_cannot_start_fails_the_start_naming_it_and_leaves_nothing_behind(cluster_and_model) -> None:
    cluster, client, blocked = cluster_and_model
    before = set(cluster.scheduler.tasks)
    with pytest.raises(DeployError, match=r"^stage actor daskpipe-stage-m-0-1-\w+ \('m' blocks \[1, 2\) on \S+\) could not start: .*mat1"):
        client.sync(start_stages, client, launches(client, blocked, second_input=(7,)), {"m": pickle_blocks(blocked.blocks)})
    poll_for(lambda: set(cluster.scheduler.tasks) <= before, timeout=5)


def test_a_stage_whose_worker_left_fails_the_start_at_once_naming_it_and_leaves_nothing_behind(cluster_and_model) -> None:
    """A re-plan can race a kill: a stage pinned to a worker no longer in the cluster would wait
    for it until the start's timeout; the start fails within a check or two, naming the stage."""
    cluster, client, blocked = cluster_and_model
    before = set(cluster.scheduler.tasks)
    first, second = launches(client, blocked)
    gone = replace(second, slot=replace(second.slot, address="tcp://127.0.0.1:9"))  # no worker there
    started = time.monotonic()
    with pytest.raises(
        DeployError, match=r"1 stage actors cannot start, their workers left the cluster: 'm' blocks \[1, 2\) on tcp://127.0.0.1:9$"
    ):
        client.sync(start_stages, client, [first, gone], {"m": pickle_blocks(blocked.blocks)}, timeout=120.0)
    assert time.monotonic() - started < 10 * WORKER_CHECK_S
    poll_for(lambda: set(cluster.scheduler.tasks) <= before, timeout=5)


def test_a_plans_stages_are_told_what_they_receive_and_their_largest_batch(cluster_and_model) -> None:
    """The first partition gets the requests' dtype, the next the feature maps' (a GPU stage
    captures its CUDA graphs for that dtype), and each one its pipeline's batch size."""
    _, client, _ = cluster_and_model
    profile, plan = two_stage("m")
    shapes = {"m": [profile.input_shape, *profile.boundary_shapes]}
    made = sorted(ppipe_launches(plan, inventory(client), shapes, {"m": "uint8"}), key=lambda launch: launch.partition)
    assert [launch.input_dtype for launch in made] == ["uint8", str(FEATURE_MAP_DTYPE).removeprefix("torch.")] == ["uint8", "float16"]
    assert [launch.options for launch in made] == [{"max_batch": BATCH}] * 2
