"""``daskpipe worker``, ``daskpipe demo`` and ``daskpipe profile cluster``: option parsing only; the
work happens in :mod:`daskpipe.runtime.worker.slots`, :mod:`daskpipe.runtime.demo` and
:mod:`daskpipe.runtime.deploying.profiling`, whose Python arguments these options mirror name for name.
Heavy imports stay inside the commands. ``daskpipe profile`` is the profiles layer's group with
the one command that needs a cluster added here (the profiles layer never imports the runtime)."""

from __future__ import annotations

from pathlib import Path

import click

from daskpipe.profiles.cli import DEFAULT_INPUT_SHAPES, NO_AUX_MODELS, parse_batch_sizes, parse_shape, profile

PROTOCOL_CHOICE = click.Choice(["tcp", "ucx"])


class CountsParam(click.ParamType):
    """``TYPE:COUNT`` pairs such as ``L4:2,T4:6``."""

    name = "TYPE:COUNT,..."

    def convert(self, value, param, ctx):
        from daskpipe.runtime.worker.slots import WorkerSpecError, parse_pairs

        if isinstance(value, dict):
            return value
        try:
            return parse_pairs(value, ":", option="--emulate")
        except WorkerSpecError as error:
            self.fail(str(error), param, ctx)


class SlicesParam(click.ParamType):
    """One MPS slice count for every GPU (``2``) or per type (``L4=2,T4=1``)."""

    name = "N|TYPE=N,..."

    def convert(self, value, param, ctx):
        from daskpipe.runtime.worker.slots import WorkerSpecError, parse_slices

        if isinstance(value, (int, dict)):
            return value
        try:
            return parse_slices(value)
        except WorkerSpecError as error:
            self.fail(str(error), param, ctx)


class MemoryLimitParam(click.ParamType):
    """A host memory limit as Dask reads it: bytes, ``4GB``, a fraction, or ``auto``."""

    name = "LIMIT"

    def convert(self, value, param, ctx):
        from daskpipe.runtime.worker.slots import WorkerSpecError, check_memory_limit

        try:
            return check_memory_limit(value)
        except WorkerSpecError as error:
            self.fail(str(error), param, ctx)


@click.command()
@click.argument("scheduler_address")
@click.option(
    "--slices",
    type=SlicesParam(),
    default="1",
    show_default=True,
    help="MPS slices per GPU, for all GPUs (2) or per type (L4=2,T4=1; unnamed types get 1). One worker "
    "per slice, with 100 // N percent of the GPU's threads; N > 1 needs the MPS control daemon.",
)
@click.option(
    "--emulate",
    type=CountsParam(),
    default=None,
    help="Emulate GPUs instead of detecting them (L4:2,T4:6): stages run on the CPU and each batch is "
    "held to the type's profiled latency. Types come from the GPU catalog.",
)
@click.option("--server", default=None, help="This node's name in worker names (default: the host name).")
@click.option("--nthreads", type=click.IntRange(min=1), default=1, show_default=True, help="Threads per slot worker.")
@click.option(
    "--protocol",
    type=PROTOCOL_CHOICE,
    default=None,
    help="Protocol of the workers (default: the scheduler address's). ucx needs distributed-ucxx and "
    "falls back to tcp with a warning without it.",
)
@click.option(
    "--memory-limit",
    type=MemoryLimitParam(),
    default="auto",
    show_default=True,
    help="Host memory per slot worker: bytes, a string like 4GB, a fraction of the machine's, or auto (an equal share of the machine's).",
)
@click.option(
    "--tls-ca-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="CA certificate(s) to trust, PEM; with --tls-cert the workers speak tls:// only.",
)
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None, help="The workers' certificate, PEM (may hold the key too)."
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The certificate's private key, PEM, when --tls-cert does not hold it.",
)
def worker(
    scheduler_address: str,
    slices: int | dict[str, int],
    emulate: dict[str, int] | None,
    server: str | None,
    nthreads: int,
    protocol: str | None,
    memory_limit: str,
    tls_ca_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
) -> None:
    """Start one Dask worker per GPU x MPS slice on this machine and connect them to SCHEDULER_ADDRESS.

    Each worker is named SERVER/TYPE-GPU/SLICE and carries the resources daskpipe.slot,
    daskpipe.gpu.TYPE and daskpipe.slices.N (and daskpipe.emulated when emulated). Runs until
    SIGINT or SIGTERM, or until the workers stop. Without --tls-* options, TLS settings come from
    Dask's configuration (distributed.comm.tls.*), as for ``dask worker``.
    """
    import asyncio

    from distributed._signals import wait_for_signals

    from daskpipe.config import ConfigError, check_settings
    from daskpipe.runtime.worker.slots import DaskpipeWorker, WorkerSpecError

    try:  # a bad daskpipe.* key stops the workers now, named, not their first stage
        check_settings()
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    security = worker_security(tls_ca_file, tls_cert, tls_key)

    async def run() -> None:
        try:
            workers = DaskpipeWorker(
                scheduler_address,
                slices=slices,
                emulate=emulate,
                server=server,
                nthreads=nthreads,
                protocol=protocol,
                memory_limit=memory_limit,
                security=security,
            )
        except WorkerSpecError as error:
            raise click.ClickException(str(error)) from None
        for slot in workers.slots:
            click.echo(f"daskpipe worker {slot.name}: {slot.resources} {slot.env}", err=True)
        signals = asyncio.create_task(wait_for_signals())
        await asyncio.sleep(0)  # its handlers are in place before the workers announce themselves
        await workers
        finished = asyncio.create_task(workers.finished())
        await asyncio.wait([signals, finished], return_when=asyncio.FIRST_COMPLETED)
        if signals.done():
            await workers.close(reason=f"signal-{signals.result()}")
        finished.cancel()
        signals.cancel()

    asyncio.run(run())


def worker_security(ca_file: str | None, cert: str | None, key: str | None):
    """The workers' ``Security`` from the --tls-* options: ``None`` without them (Dask's configuration
    applies); with them, TLS required on every comm, so no plain-TCP peer gets through."""
    if ca_file is None and cert is None and key is None:
        return None
    if ca_file is None or cert is None:
        raise click.UsageError("TLS needs both --tls-ca-file and --tls-cert (and --tls-key unless the certificate file holds the key)")
    from distributed.security import Security

    return Security(tls_ca_file=ca_file, tls_worker_cert=cert, tls_worker_key=key, require_encryption=True)


@click.command()
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds of request stream; start-up adds 20-40 s.",
)
@click.option(
    "--dashboard-address",
    default=":8787",
    show_default=True,
    help="Where the Dask dashboard (with the daskpipe pages) listens.",
)
@click.option(
    "--protocol",
    type=PROTOCOL_CHOICE,
    default="tcp",
    show_default=True,
    help="Protocol of the local cluster; ucx falls back to tcp with a warning without distributed-ucxx.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary as JSON to this file.",
)
def demo(duration: float, dashboard_address: str, protocol: str, json_path: Path | None) -> None:
    """Serve a torchvision CNN on emulated L4 and T4 GPUs under a Poisson request stream, then summarise."""
    from daskpipe.runtime.demo import run_demo

    run_demo(duration=duration, dashboard_address=dashboard_address, protocol=protocol, json_path=json_path)


@profile.command("cluster")
@click.argument("scheduler")
@click.argument("model")
@click.option(
    "--store",
    "store_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Profile store folder to fill (deploy(profiling=ProfilingOptions(store=...)) reads it).",
)
@click.option("--name", default=None, help="Model name in the profile [default: MODEL].")
@click.option("--blocks", default=10, show_default=True, help="Number of blocks to cut the model into (as deploy's num_blocks).")
@click.option("--batch-sizes", default="1,2,4,8", show_default=True, help="Batch sizes to time (as deploy's batch_sizes).")
@click.option("--input-shape", default=None, help="Per-sample input shape [default: 3,224,224; 3,299,299 for inception_v3].")
@click.option(
    "--timeout", "timeout_s", type=float, default=None, help="Most seconds profiling may take; kinds not done by then are left out."
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the profile JSON here.")
def cluster_command(
    scheduler: str,
    model: str,
    store_dir: Path,
    name: str | None,
    blocks: int,
    batch_sizes: str,
    input_shape: str | None,
    timeout_s: float | None,
    out: Path | None,
) -> None:
    """Profile MODEL on every (GPU type, slices) kind of the cluster at SCHEDULER, as deploy does, and
    keep the tables in the store. MODEL is ``package.module:factory`` (a callable returning the
    nn.Module that will be deployed: the store key hashes its weights) or a torchvision name
    (random weights from seed 0)."""
    import torch
    from distributed import Client

    from daskpipe.profiles.store import ProfileStore
    from daskpipe.runtime.client.service import inventory
    from daskpipe.runtime.deploying.profiling import profile_on_cluster
    from daskpipe.runtime.errors import DeployError

    module = _build_model(model)
    shape = parse_shape(input_shape or DEFAULT_INPUT_SHAPES.get(model, "3,224,224"))
    store = ProfileStore(store_dir)
    with Client(scheduler) as client:
        try:
            result = profile_on_cluster(
                client,
                inventory(client),
                name or model,
                module,
                torch.randn(1, *shape),
                slo_us=None,
                num_blocks=blocks,
                batch_sizes=parse_batch_sizes(batch_sizes),
                store=store,
                timeout_s=timeout_s,
            )
        except DeployError as exc:
            raise click.ClickException(str(exc)) from None
    if out:
        result.profile.save(out)
    tables = ", ".join(f"{kind} {origin}" for kind, origin in sorted(result.profile.meta["tables"].items()))
    click.echo(f"{store_dir}: {len(store)} measured table(s); {name or model}: {tables}; {result.profiling_tasks} profiling task(s) now")


def _build_model(model: str):
    """``package.module:factory()`` or torchvision's ``model`` with seeded random weights, in eval mode."""
    import importlib

    import torch
    import torchvision

    if ":" in model:
        module_name, _, attribute = model.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise click.BadParameter(f"{model!r}: cannot load {attribute} from {module_name} ({exc})") from None
        return factory().eval()
    available = torchvision.models.list_models(module=torchvision.models)
    if model not in available:
        raise click.BadParameter(
            f"{model!r} is neither package.module:factory nor a torchvision classification model ({', '.join(available)})"
        )
    torch.manual_seed(0)
    extra = {"aux_logits": False, "init_weights": False} if model in NO_AUX_MODELS else {}
    return torchvision.models.get_model(model, weights=None, **extra).eval()
