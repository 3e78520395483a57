"""``daskpipe worker`` and ``daskpipe demo``: option parsing only; the work happens in
:mod:`daskpipe.runtime.worker` and :mod:`daskpipe.runtime.demo`, whose Python arguments these
options mirror name for name. Heavy imports stay inside the commands."""

from __future__ import annotations

from pathlib import Path

import click

PROTOCOL_CHOICE = click.Choice(["tcp", "ucx"])


class CountsParam(click.ParamType):
    """``TYPE:COUNT`` pairs such as ``L4:2,T4:6``."""

    name = "TYPE:COUNT,..."

    def convert(self, value, param, ctx):
        from daskpipe.runtime.worker import WorkerSpecError, parse_pairs

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
        from daskpipe.runtime.worker import WorkerSpecError, parse_slices

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
        from daskpipe.runtime.worker import WorkerSpecError, check_memory_limit

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
    help="Host memory per slot worker: bytes, a string like 4GB, a fraction of the machine's, or auto "
    "(an equal share of the machine's).",
)
@click.option("--tls-ca-file", type=click.Path(exists=True, dir_okay=False), default=None, help="CA certificate(s) to trust, PEM; with --tls-cert the workers speak tls:// only.")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None, help="The workers' certificate, PEM (may hold the key too).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="The certificate's private key, PEM, when --tls-cert does not hold it.")
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

    from daskpipe.runtime.worker import DaskpipeWorker, WorkerSpecError

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
    "--duration", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True, help="Seconds of request stream; start-up adds 20-40 s."
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
