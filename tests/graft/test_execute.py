"""Fragments entering one model at three blocks, through one shared stage, give the whole model's outputs."""

from __future__ import annotations

import pytest
import torch

from daskpipe.graft import Fragment, GraftPlan, GroupPlan, Level, StageConfig
from daskpipe.graft.execute import EntryError, StageActor, check_entry, execute
from daskpipe.profiles.estimator import estimate_profile
from daskpipe.profiles.fx import segment_model
from tests.graft.helpers import tiny_model


@pytest.fixture(scope="module")
def tiny():
    module = tiny_model()
    segmented = segment_model(module, torch.zeros(1, 3, 16, 16))
    blocked = segmented.cut(sorted({0, 1, 2, 3, segmented.num_segments}))
    profile = estimate_profile(blocked, gpus=["V100"], name="tiny", batch_sizes=1, slices=(1,))
    return module, blocked, profile


def shared_plan(profile):
    """Devices enter at blocks 0, 1 and 2; all are re-aligned at block 2 and share [2, N) at batch 8."""
    fragments = tuple(Fragment("tiny", k, 50.0, 30.0, (f"dev{k}",)) for k in (0, 1, 2))
    private = tuple(StageConfig(k, 2, 2, 10, 1, 1.0, 30.0) for k in (0, 1)) + (None,)
    level = Level(2, fragments, private, StageConfig(2, profile.num_blocks, 8, 30, 1, 2.0, 90.0))
    return GraftPlan("tiny", "V100", (GroupPlan((level,)),)).serving()


def device_requests(module, blocked):
    images = {k: torch.randn(2, 3, 16, 16) for k in (0, 1, 2)}
    return images, {f"dev{k}": (k, blocked.run(images[k], end=k) if k else images[k]) for k in (0, 1, 2)}


def test_in_process_equals_whole_model(tiny) -> None:
    module, blocked, profile = tiny
    plan = shared_plan(profile)
    images, requests = device_requests(module, blocked)
    outputs = execute(plan, blocked, profile, requests)
    for k, image in images.items():
        torch.testing.assert_close(outputs[f"dev{k}"], module(image), rtol=1e-2, atol=1e-2)


def test_local_cluster_shared_stage_batches_three_entries(tiny) -> None:
    distributed = pytest.importorskip("distributed")
    module, blocked, profile = tiny
    plan = shared_plan(profile)
    images, requests = device_requests(module, blocked)
    batches_seen: list[tuple[int, int]] = []
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        distributed.Client(cluster) as client,
    ):
        actors = [client.submit(StageActor, blocked.stage(s.start, s.end), actor=True).result() for s in plan.stages]

        def run_stage(index: int, batch: torch.Tensor) -> torch.Tensor:
            batches_seen.append((index, len(batch)))
            return actors[index].run(batch).result()

        outputs = execute(plan, blocked, profile, requests, run_stage=run_stage)
    shared_index = plan.routes["dev2"][0]
    assert (shared_index, 6) in batches_seen  # one batch holds the samples of all three entry blocks
    for k, image in images.items():
        torch.testing.assert_close(outputs[f"dev{k}"], module(image), rtol=1e-2, atol=1e-2)


def test_wrong_entry_shape_is_a_clear_error(tiny) -> None:
    _, blocked, profile = tiny
    with pytest.raises(EntryError, match="block 1 expects per-sample shape"):
        check_entry(profile, 1, torch.zeros(1, 3, 16, 16))
    with pytest.raises(EntryError, match="start_block must be in"):
        check_entry(profile, profile.num_blocks, torch.zeros(1, 3, 16, 16))
    plan = shared_plan(profile)
    with pytest.raises(EntryError, match="route starts at block"):
        execute(plan, blocked, profile, {"dev2": (1, blocked.run(torch.zeros(1, 3, 16, 16), end=1))})
