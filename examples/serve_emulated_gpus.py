"""Serve a torchvision CNN on a cluster of emulated heterogeneous GPUs, with inference futures.

Starts an ``EmulatedCluster`` (one Dask worker per GPU slot; stages compute on the CPU and hold
each batch to the emulated GPU's latency, time-dilated so a laptop keeps up), deploys ResNet-18
with ``daskpipe.deploy`` (profiles, MILP plan, stage actors), then submits requests with
``Service.submit`` as ordinary ``distributed.Future``\\ s (``Service.map`` takes many at once). Every
request ends with its output or a daskpipe error saying why. Watch it at the dashboard address it
prints (pages ``/daskpipe-plan``, ``/daskpipe-slos``, ``/daskpipe-gpus``, ``/daskpipe-batches``).

    python examples/serve_emulated_gpus.py --gpus L4:1,T4:2 --requests 200

On a real cluster, replace the ``EmulatedCluster`` with ``Client("tcp://scheduler:8786")`` and
start ``daskpipe worker`` on each GPU node (docs/deploying.md).
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from distributed import Client, as_completed

import daskpipe
from daskpipe.runtime.cluster import EmulatedCluster
from daskpipe.runtime.errors import DaskpipeError

FRAME = (3, 64, 64)  # small frames: the CPU computes every stage for real
SLO_MS = 10.0  # on the emulated GPUs; the service runs it time-dilated
TIME_DILATION = 300.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="L4:1,T4:2", help="emulated GPUs, TYPE:COUNT[,...]")
    parser.add_argument("--requests", type=int, default=200, help="requests sent as a Poisson stream")
    parser.add_argument("--dashboard-address", default=":8787")
    args = parser.parse_args()
    gpus = {name: int(count) for name, count in (item.split(":") for item in args.gpus.split(","))}

    torch.set_num_threads(1)  # the workers share the machine's cores
    model = torchvision.models.resnet18(num_classes=10).eval()
    frames = [torch.randn(1, *FRAME) for _ in range(16)]
    with EmulatedCluster(gpus, dashboard_address=args.dashboard_address) as cluster, Client(cluster) as client:
        print(f"dashboard: {cluster.dashboard_link.removesuffix('/status')}/daskpipe-slos")
        svc = daskpipe.deploy(
            client, {"resnet18": model}, example_inputs={"resnet18": frames[0]}, slo_ms={"resnet18": SLO_MS}, time_dilation=TIME_DILATION
        )
        try:
            for part in (p for pipeline in svc.plan.model("resnet18").pipelines for p in pipeline.partitions):
                print(f"pool: {part.gpu} 1/{part.slices} x{part.vgpus}, blocks [{part.blocks[0]},{part.blocks[1]})")

            out = svc.submit("resnet18", frames[0]).result()  # one request, one Future
            with torch.no_grad():
                print(f"one request: output {tuple(out.shape)}, max |output - model| = {(out.float() - model(frames[0])).abs().max():.2e}")

            try:  # bad input errs at once, naming the problem; the service keeps serving
                svc.submit("resnet18", torch.randn(1, 3, 32, 32)).result()
            except DaskpipeError as error:
                print(f"a wrong shape: {type(error).__name__}: {error}")

            rate = 0.7 * svc.plan.model("resnet18").throughput / TIME_DILATION  # 70% of the plan's capacity, in real req/s
            print(f"sending {args.requests} requests at {rate:.1f} req/s (Poisson)")
            futures, start = [], time.perf_counter()
            for gap in torch.distributions.Exponential(rate).sample((args.requests,)).tolist():
                time.sleep(gap)
                futures.append(svc.submit("resnet18", frames[len(futures) % len(frames)]))
            ended: dict[str, int] = {}
            for future in as_completed(futures):
                outcome = type(future.exception()).__name__ if future.status == "error" else "output"
                ended[outcome] = ended.get(outcome, 0) + 1
            print(f"{args.requests} requests in {time.perf_counter() - start:.1f} s: {ended}")
            print(f"status: {svc.status()}")
        finally:
            svc.close()


if __name__ == "__main__":
    main()
