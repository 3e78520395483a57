"""The ``daskpipe`` command. Subcommands live beside the code they drive (the benchmarks' in
``daskpipe.benchmarks``) and load lazily, so ``daskpipe --help`` and light commands do not pay for
importing torch or distributed."""

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
    name="daskpipe",  # the name `dask daskpipe` registers it under (Dask's CLI adds a group by its own name)
    cls=LazyGroup,
    lazy={
        "plan": "daskpipe.plan.cli:plan",
        "profile": "daskpipe.runtime.cli:profile",  # the profiles group, with `profile cluster` added
        "simulate": "daskpipe.sim.cli:simulate",
        "experiments": "daskpipe.benchmarks.experiments:experiments",
        "bench": "daskpipe.benchmarks.cli:bench",
        "worker": "daskpipe.runtime.cli:worker",
        "demo": "daskpipe.runtime.cli:demo",
    },
)
@click.version_option(package_name="daskpipe")
def main() -> None:
    """Serve DNN inference with latency SLOs on heterogeneous GPU clusters, on Dask."""
