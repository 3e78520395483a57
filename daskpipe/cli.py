"""The ``daskpipe`` command. Subcommands live beside the code they drive and load lazily, so
``daskpipe --help`` and light commands do not pay for importing torch or distributed."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """A click group whose subcommands are ``"module:attribute"`` strings, imported on use."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attr = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(
    cls=LazyGroup,
    lazy={
        "plan": "daskpipe.plan.cli:plan",
        "profile": "daskpipe.runtime.cli:profile",  # the profiles group, with `profile cluster` added
        "simulate": "daskpipe.sim.cli:simulate",
        "experiments": "daskpipe.sim.experiments:experiments",
        "worker": "daskpipe.runtime.cli:worker",
        "demo": "daskpipe.runtime.cli:demo",
    },
)
@click.version_option(package_name="daskpipe")
def main() -> None:
    """Serve DNN inference with latency SLOs on heterogeneous GPU clusters, on Dask."""


@main.group(
    cls=LazyGroup,
    lazy={
        "plan": "daskpipe.plan.bench:bench_plan",
        "scheduler": "daskpipe.sched.bench:bench_scheduler",
        "runtime": "daskpipe.runtime.bench:bench_runtime",
        "colocation": "daskpipe.colocation.bench:bench_colocation",
        "colocation-plan": "daskpipe.colocation.compare:bench_colocation_plan",
        "graft": "daskpipe.graft.bench:bench_graft",
        "overload": "daskpipe.runtime.overload:bench_overload",
        "chaos": "daskpipe.runtime.chaos:bench_chaos",
        "dashboard": "daskpipe.dashboard.bench:bench_dashboard",
        "goodput": "daskpipe.benchmarks.goodput:bench_goodput",
        "fidelity": "daskpipe.benchmarks.fidelity:bench_fidelity",
    },
)
def bench() -> None:
    """Benchmarks; each prints (and with --json writes) its figures as JSON."""
