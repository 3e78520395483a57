"""``daskpipe bench``: every benchmark's command, loaded on use."""

from __future__ import annotations

import click

from daskpipe.cli import LazyGroup


@click.group(
    "bench",
    cls=LazyGroup,
    lazy={
        "plan": "daskpipe.benchmarks.planning:bench_plan",
        "planning": "daskpipe.benchmarks.planning_scale:bench_planning",
        "scheduler": "daskpipe.benchmarks.scheduling:bench_scheduler",
        "runtime": "daskpipe.benchmarks.runtime_overhead:bench_runtime",
        "colocation": "daskpipe.benchmarks.colocation:bench_colocation",
        "colocation-plan": "daskpipe.benchmarks.colocation_plan:bench_colocation_plan",
        "graft": "daskpipe.benchmarks.graft:bench_graft",
        "overload": "daskpipe.benchmarks.overload:bench_overload",
        "chaos": "daskpipe.benchmarks.chaos:bench_chaos",
        "dashboard": "daskpipe.benchmarks.dashboard:bench_dashboard",
        "goodput": "daskpipe.benchmarks.goodput:bench_goodput",
        "fidelity": "daskpipe.benchmarks.fidelity:bench_fidelity",
        "serve": "daskpipe.benchmarks.serve:bench_serve",
        "capacity": "daskpipe.benchmarks.capacity:bench_capacity",
        "subclusters": "daskpipe.benchmarks.subclusters:bench_subclusters",
        "symphony": "daskpipe.benchmarks.symphony:bench_symphony",
        "multiplex": "daskpipe.benchmarks.multiplex:bench_multiplex",
        "tight-slo": "daskpipe.benchmarks.tight_slo:bench_tight_slo",
    },
)
def bench() -> None:
    """Benchmarks; each prints (and with --json writes) its figures as JSON."""
