"""Plan two torchvision CNNs on a heterogeneous GPU inventory and simulate the plan under load.

No GPU and no cluster needed: the profiles come from daskpipe's analytic estimator (a real
profile of your GPUs is better: ``daskpipe profile``), the MILP plans pools of each GPU type, and
the discrete-event simulator serves Poisson arrivals with the same data plane the runtime runs.

    python examples/plan_and_simulate.py --gpus L4=2,T4=4 --load 0.8
"""

from __future__ import annotations

import argparse

import torch
import torchvision

from daskpipe.plan.milp import make_plan
from daskpipe.profiles.estimator import estimate_profile
from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import simulate

MODELS = {"resnet50": torchvision.models.resnet50, "mobilenet_v3_large": torchvision.models.mobilenet_v3_large}
SLO_MS = {"resnet50": 60.0, "mobilenet_v3_large": 25.0}


def parse_gpus(text: str) -> dict[str, int]:
    """``L4=2,T4=4`` -> {"L4": 2, "T4": 4}."""
    try:
        return {name: int(count) for name, count in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes TYPE=COUNT[,TYPE=COUNT...], got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=parse_gpus, default=parse_gpus("L4=2,T4=4"), help="the inventory, e.g. L4=2,T4=4")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of the plan's throughput")
    parser.add_argument("--duration", type=float, default=10.0, help="simulated seconds of arrivals")
    args = parser.parse_args()

    example = torch.randn(1, 3, 224, 224)
    profiles = {
        name: estimate_profile(build().eval(), example, gpus=sorted(args.gpus), name=name, slo_us=SLO_MS[name] * 1e3, slices=(1, 2))
        for name, build in MODELS.items()
    }
    plan = make_plan(profiles, args.gpus, gpus_per_server={gpu: 1 for gpu in args.gpus})
    for model in plan.models:
        print(f"{model.name}: {model.throughput:.0f} req/s planned, SLO {model.slo_us / 1e3:g} ms")
        for pipeline in model.pipelines:
            pools = " -> ".join(f"{p.gpu} 1/{p.slices} x{p.vgpus} blocks [{p.blocks[0]},{p.blocks[1]})" for p in pipeline.partitions)
            print(f"  batch {pipeline.batch_size}, {pipeline.throughput:.0f} req/s: {pools}")

    result = simulate(plan, profiles, SimulationConfig(duration=args.duration), load_factor=args.load)
    for name, model in result.models.items():
        print(
            f"simulated {name} at load {args.load:g}: {model.submitted} requests, SLO attainment {model.attainment:.4f}, p99 "
            f"{model.p99_ms:.1f} ms, dropped {model.dropped_total}"
        )


if __name__ == "__main__":
    main()
