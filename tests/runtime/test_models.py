"""Every kind of model a user brings, served on one emulated cluster and checked against the
unpartitioned model in eval mode: several inputs, tuple and dict outputs, token ids, TorchScript,
``torch.compile``, segmentation and detection cut into two partitions; and the same cut on two
clusters whose workers registered in opposite orders."""

from __future__ import annotations

import socket
from contextlib import ExitStack, contextmanager

import pytest
import torch
import torchvision
from distributed import Client, Worker
from torch import nn
from torch.utils._pytree import tree_flatten

import daskpipe
from daskpipe.profiles.fx import UncutWarning, call_arguments
from daskpipe.runtime.client.service import inventory
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.deploying.profiling import ProfilingOptions, profile_on_cluster
from daskpipe.runtime.errors import DeployError
from daskpipe.runtime.worker.slots import worker_specs
from tests.runtime.helpers import two_pool_plan, with_test_dispatcher

pytestmark = pytest.mark.timeout(300)
REQUESTS = 5
SLO_US = 2e6
"""The emulated stages compute for real on a shared CPU: no request may be dropped as late (the test
dispatcher waits a quarter of it for a full batch)."""


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster({"L4": 1, "T4": 1}, processes=False, dashboard_address=None) as emulated, Client(emulated) as client:
        with_test_dispatcher(client, emulated.scheduler)
        yield client


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(6, 16)
        self.text = nn.Linear(4, 16)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.head(self.image(image) + self.text(text))


class TupleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16))
        self.logits = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.logits(features), features.norm(dim=1)


class TokenClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(5 * 8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))


class MaskedTokens(TokenClassifier):
    """Token ids and a bool mask over them, by keyword: a language model's inputs."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.head(self.embedding(ids) * mask.unsqueeze(-1))


def requests(example, seed: int = 1) -> list:
    """``REQUESTS`` requests of ``example``'s form, shapes and dtypes."""
    generator = torch.Generator().manual_seed(seed)
    leaves, spec = tree_flatten(example)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=generator, dtype=t.dtype)
        if t.dtype == torch.bool:
            return torch.rand(t.shape, generator=generator) > 0.5
        return torch.randint(0, 100, t.shape, generator=generator, dtype=t.dtype)

    return [spec.unflatten([like(t) for t in leaves]) for _ in range(REQUESTS)]


def assert_served_as_eval(svc, name: str, model: nn.Module, example, atol: float = 1e-4) -> None:
    """Each served output matches ``model`` in eval mode, leaf by leaf (fp16 hops allow ``atol`` relative to the largest value)."""
    xs = requests(example)
    outputs = [f.result(timeout=120) for f in svc.map(name, xs)]
    model.eval()
    with torch.inference_mode():
        for x, got in zip(xs, outputs):
            args, kwargs = call_arguments(x)
            want = model(*args, **kwargs)
            scale = max([1.0, *(t.abs().max().item() for t in tree_flatten(want)[0] if t.numel())])
            torch.testing.assert_close(got, want, atol=atol * scale, rtol=1e-2)  # mappings by key, sequences by position


def deploy_whole(client, name: str, model: nn.Module, example, profiling: ProfilingOptions = ProfilingOptions(num_blocks=2)):
    return daskpipe.deploy(
        client,
        {name: model},
        example_inputs={name: example},
        slo_ms={name: SLO_US / 1e3},
        dispatcher="fifo",
        profiling=profiling,
    )


@pytest.mark.parametrize(
    "build, example",
    [
        (TwoInputs, (torch.randn(1, 6), torch.randn(1, 4))),
        (TwoInputs, {"image": torch.randn(1, 6), "text": torch.randn(1, 4)}),
        (TupleOutput, torch.randn(1, 6)),
        (TokenClassifier, torch.randint(0, 100, (1, 5))),
        (MaskedTokens, {"ids": torch.randint(0, 100, (1, 5)), "mask": torch.ones(1, 5, dtype=torch.bool)}),
    ],
    ids=["two-inputs", "keyword-inputs", "tuple-output", "embedding-int64", "ids-and-bool-mask"],
)
def test_models_of_any_inputs_and_outputs_serve_as_their_eval_model(cluster, build, example):
    torch.manual_seed(0)
    model = build().eval()
    with deploy_whole(cluster, "model", model, example) as svc:
        assert svc.profiles["model"].num_blocks == 2
        assert_served_as_eval(svc, "model", model, example)


@pytest.mark.parametrize(
    "example, message",
    [
        (torch.randn(1, 6, dtype=torch.float16), "must have the same dtype"),
        (torch.randn(1, 5), "mat1 and mat2 shapes cannot be multiplied"),
    ],
    ids=["fp16-example", "wrong-width-example"],
)
def test_a_wrong_example_fails_the_deploy_with_torchs_own_message(cluster, example, message):
    with pytest.raises(
        DeployError, match=f"cannot be profiled: running TupleOutput on the example failed at node 'body_0' in module 'body.0'.*{message}"
    ) as failed:
        deploy_whole(cluster, "wrong", TupleOutput().eval(), example)
    assert "While executing" not in str(failed.value), "torch's message, not fx's node dump after it"


def test_torchscript_is_served_whole_with_a_warning_saying_why(cluster):
    torch.manual_seed(0)
    model = torch.jit.script(TokenClassifier().eval())
    example = torch.randint(0, 100, (1, 5))
    with pytest.warns(UncutWarning, match="TorchScript"):
        svc = deploy_whole(cluster, "scripted", model, example)
    with svc:
        assert svc.profiles["scripted"].num_blocks == 1
        assert_served_as_eval(svc, "scripted", model, example)


def test_a_compiled_resnet_is_cut_as_the_module_it_compiles(cluster):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    example = torch.randn(1, 3, 32, 32)
    with deploy_whole(cluster, "compiled", torch.compile(model), example) as svc:
        assert svc.profiles["compiled"].num_blocks == 2
        assert_served_as_eval(svc, "compiled", model, example, atol=1e-2)


def test_a_train_mode_model_is_served_in_eval_mode_and_left_as_it_was(cluster):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    example = torch.randn(1, 6)
    with pytest.warns(UncutWarning, match="train mode"):
        svc = deploy_whole(cluster, "training", model, example)
    assert model.training, "the caller's model keeps its mode"
    with svc:
        assert_served_as_eval(svc, "training", model, example)


def test_segmentation_is_cut_into_two_partitions_on_two_pools(cluster):
    torch.manual_seed(0)
    model = torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None).eval()
    example = torch.randn(1, 3, 64, 64)
    measured = profile_on_cluster(cluster, inventory(cluster), "fcn", model, example, slo_us=SLO_US, num_blocks=4, batch_sizes=1)
    profile = measured.profile
    assert profile.num_blocks == 4
    plan = two_pool_plan(profile, 2, batch=1)
    svc = daskpipe.deploy(cluster, {"fcn": model}, example_inputs={"fcn": example}, plan=plan, profiles={"fcn": profile}, dispatcher="fifo")
    with svc:
        (pipeline,) = svc.plan.model("fcn").pipelines
        assert [(p.blocks, p.gpu) for p in pipeline.partitions] == [((0, 2), "L4"), ((2, 4), "T4")]
        assert_served_as_eval(svc, "fcn", model, example, atol=1e-2)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now, lowest first."""
    with ExitStack() as sockets:
        bound = [sockets.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(count)]
        return sorted(s.getsockname()[1] for s in bound)


@contextmanager
def registered_in_order(first: str, then: str):
    """A client of a cluster of one ``first`` slot, to which a ``then`` slot worker is added once
    it has registered, as ``daskpipe worker --emulate`` adds one. Slots are listed by address, so
    ``first`` is given the lower port: listed first, as it registered."""
    low, high = free_ports(2)
    with EmulatedCluster({first: 1}, processes=False, dashboard_address=None, port=low) as emulated, Client(emulated) as client:
        with_test_dispatcher(client, emulated.scheduler)
        (slot,) = worker_specs(emulate={then: 1}, server="node-1")
        added = emulated.sync(Worker, emulated.scheduler_address, host="127.0.0.1", port=high, nthreads=1, **slot.worker_options())
        try:
            client.wait_for_workers(2)
            yield client
        finally:
            emulated.sync(added.close)


def test_the_cut_does_not_depend_on_the_order_workers_registered_in():
    model = torchvision.models.efficientnet_b0(weights=None).eval()
    example = torch.randn(1, 3, 32, 32)
    listed, profiles = [], []
    for first, then in (("L4", "T4"), ("T4", "L4")):
        with registered_in_order(first, then) as client:
            listed.append([slot.gpu for slot in inventory(client)])
            with deploy_whole(client, "efficientnet", model, example, ProfilingOptions(num_blocks=4, batch_sizes=1)) as svc:
                profiles.append(svc.profiles["efficientnet"])
    assert listed == [["L4", "T4"], ["T4", "L4"]]
    assert profiles[0].num_blocks == 4
    assert profiles[0].meta["segment_boundaries"] == profiles[1].meta["segment_boundaries"]
    assert profiles[0].boundary_bytes == profiles[1].boundary_bytes


def seeded_detector() -> nn.Module:
    """fasterrcnn_mobilenet_v3_large_320_fpn from a seeded random init, with the two things a trained
    one has that matching it through an fp16 hop needs, and its five best boxes kept.

    torchvision leaves a random backbone's batch-norm statistics at the identity, so its activations
    shrink to ~1e-7 by its last stages, under fp16's smallest normal number (6e-5): a hop there loses
    about half of their value, and the head, seeing next to nothing, scores every box the same (the
    boxes tie, and an fp16 hop changes which of them NMS keeps and in what order). Statistics of
    random images, as a trained model's are of its data, keep them at unit scale. A random box
    classifier scores each class ~1/91, under the 0.05 threshold; its weights x20 spread the scores
    (0.6-0.99) as a trained one's are. A hop then moves a score by at most ~3e-4 and a box by ~0.02
    px; what it can still change is which proposal the RPN keeps at its cut-off of 150, and in 1 of
    100 random images the one swapped carried a kept box."""
    torch.manual_seed(0)
    detection = torchvision.models.detection
    model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, box_detections_per_img=5).eval()
    for norm in model.backbone.modules():
        if isinstance(norm, nn.BatchNorm2d):
            norm.reset_running_stats()
            norm.momentum = None  # the plain average of the batches seen
    with torch.no_grad():
        images, _ = model.transform(list(torch.randn(4, 3, 320, 320)))
        model.backbone.train()(images.tensors)
        model.backbone.eval()
        model.roi_heads.box_predictor.cls_score.weight *= 20
    return model


def test_detection_is_cut_inside_its_backbone_into_two_partitions_on_two_pools(cluster):
    model = seeded_detector()
    example = torch.randn(1, 3, 320, 320)
    with pytest.warns(UncutWarning, match="cut inside its submodule 'backbone' only"):
        measured = profile_on_cluster(cluster, inventory(cluster), "detector", model, example, slo_us=SLO_US, num_blocks=6, batch_sizes=1)
    profile = measured.profile
    assert profile.num_blocks >= 4  # greedy balancing leaves out blocks the heavy head (a whole segment) takes the share of
    svc = daskpipe.deploy(
        cluster,
        {"detector": model},
        example_inputs={"detector": example},
        plan=two_pool_plan(profile, profile.num_blocks - 1, batch=1),
        profiles={"detector": profile},
        dispatcher="fifo",
    )
    with svc:
        (pipeline,) = svc.plan.model("detector").pipelines
        assert [p.gpu for p in pipeline.partitions] == ["L4", "T4"]
        xs = requests(example)
        outputs = [svc.submit("detector", x).result(timeout=120) for x in xs]  # one at a time: a second of CPU each
    with torch.inference_mode():
        for x, (served,) in zip(xs, outputs):
            (want,) = model(x)
            assert served.keys() == want.keys() and len(want["boxes"]) == 5
            torch.testing.assert_close(served["labels"], want["labels"], rtol=0, atol=0)
            torch.testing.assert_close(served["boxes"], want["boxes"], rtol=1e-3, atol=1e-2)  # in pixels of a 320 px image
            torch.testing.assert_close(served["scores"], want["scores"], rtol=0, atol=1e-3)
