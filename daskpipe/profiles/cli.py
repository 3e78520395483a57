"""``daskpipe profile``: measure, estimate, check and show model profiles.

Heavy imports (torch, torchvision) happen inside the commands so ``daskpipe --help`` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click

DEFAULT_INPUT_SHAPES = {"inception_v3": "3,299,299"}
NO_AUX_MODELS = ("inception_v3", "googlenet")


def parse_batch_sizes(text: str) -> list[int]:
    """``"1-8"`` -> 1..8, ``"1,2,4"`` -> those, ``"8"`` -> 1..8."""
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            sizes = list(range(low, high + 1))
        elif "," in text:
            sizes = [int(part) for part in text.split(",")]
        else:
            sizes = list(range(1, int(text) + 1))
    except ValueError:
        raise click.BadParameter(f"{text!r}: use a range '1-8', a list '1,2,4,8' or a maximum '8'") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{text!r}: batch sizes must be integers >= 1")
    return sizes


def parse_names(text: str | None) -> list[str] | None:
    return [name.strip() for name in text.split(",") if name.strip()] if text else None


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers such as 3,224,224") from None
    if not shape or min(shape) < 1:
        raise click.BadParameter(f"{text!r}: dimensions must be positive")
    return shape


class ProfileGroup(click.Group):
    """Turns the package's input errors into one-line CLI errors instead of tracebacks."""

    def invoke(self, ctx: click.Context):
        from daskpipe.profiles.model import ProfileError

        try:
            return super().invoke(ctx)
        except ProfileError as exc:
            raise click.ClickException(str(exc)) from exc
        except ValueError as exc:  # SegmentationError and bad arguments to the profiler
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


@click.group(cls=ProfileGroup)
def profile() -> None:
    """Measure, estimate, check and show model profiles."""


@profile.command("torchvision")
@click.argument("model")
@click.option("--blocks", default=10, show_default=True, help="Number of blocks to cut the model into.")
@click.option("--batch-sizes", default="1-8", show_default=True, help="Range '1-8', list '1,2,4,8' (others interpolated) or maximum '8'.")
@click.option("--input-shape", default=None, help="Per-sample input shape [default: 3,224,224; 3,299,299 for inception_v3].")
@click.option("--device", default="cpu", show_default=True, help="Torch device to time on (cpu, cuda, cuda:1).")
@click.option("--slices", default=1, show_default=True, help="MPS slice count this process runs in (labels the table).")
@click.option("--repeats", default=5, show_default=True, help="Timed runs per measurement (median kept).")
@click.option(
    "--cpu-threads", type=int, default=None, help="Torch intra-op threads when timing on the CPU (1 is stable on a busy machine)."
)
@click.option("--slo-us", type=float, default=None, help="Latency SLO in µs [default: 5x the batch-1 latency].")
@click.option("--estimate", "estimate_gpus", default=None, help="Comma-separated catalog GPU types to add estimated tables for.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Profile JSON to write.")
def torchvision_command(
    model: str,
    blocks: int,
    batch_sizes: str,
    input_shape: str | None,
    device: str,
    slices: int,
    repeats: int,
    cpu_threads: int | None,
    slo_us: float | None,
    estimate_gpus: str | None,
    out: Path,
) -> None:
    """Profile torchvision MODEL (random weights) on the local device, optionally adding estimates."""
    import torch
    import torchvision
    from rich.progress import Progress, TaskID

    from daskpipe.profiles.catalog import load_catalog
    from daskpipe.profiles.estimator import estimate_profile
    from daskpipe.profiles.profiler import profile_model

    available = torchvision.models.list_models(module=torchvision.models)
    if model not in available:
        raise click.BadParameter(f"{model!r} is not a torchvision classification model; choose from: {', '.join(available)}")
    extra = {"aux_logits": False, "init_weights": False} if model in NO_AUX_MODELS else {}
    module = torchvision.models.get_model(model, weights=None, **extra).eval()
    shape = parse_shape(input_shape or DEFAULT_INPUT_SHAPES.get(model, "3,224,224"))
    sizes = parse_batch_sizes(batch_sizes)
    targets = parse_names(estimate_gpus) or []
    known = load_catalog()
    if any(gpu not in known for gpu in targets):
        raise click.BadParameter(f"--estimate {estimate_gpus!r}: the catalog knows {', '.join(sorted(known))}")

    with Progress(transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(f"timing {stage}", total=total)
            bar.update(tasks[stage], completed=done)

        measured, blocked = profile_model(
            module,
            torch.randn(1, *shape),
            name=model,
            num_blocks=blocks,
            batch_sizes=sizes,
            device=device,
            slices=slices,
            slo_us=slo_us,
            repeats=repeats,
            cpu_threads=cpu_threads,
            progress=report,
        )
    result = measured
    if targets:
        estimated = estimate_profile(blocked, gpus=targets, name=model, batch_sizes=max(sizes), slo_us=measured.slo_us)
        result = replace(
            measured,
            latency_us={**estimated.latency_us, **measured.latency_us},
            meta={**measured.meta, "estimated": dict(estimated.meta)},
        )
    result.save(out)
    click.echo(f"wrote {out}: {model}, {result.num_blocks} blocks, tables {', '.join(f'{g}/v{v}' for g, v in sorted(result.latency_us))}")


@profile.command("estimator-error")
@click.option(
    "--profiles",
    "profiles_dir",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="Folder of measured tables (the ../shared/ppipe layout).",
)
@click.option("--models", default=None, help="Comma-separated models (names or prefixes) [default: all with a torchvision build].")
@click.option("--gpus", default=None, help="Comma-separated GPU types [default: all the models share].")
@click.option(
    "--calibrate", is_flag=True, help="Also calibrate on one measured GPU type and test on the others, leaving each type out in turn."
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Also write the report here.")
def estimator_error_command(profiles_dir: Path, models: str | None, gpus: str | None, calibrate: bool, json_out: Path | None) -> None:
    """Print the estimator's error against measured tables as JSON (leave-one-model-out and in-sample;
    with --calibrate, median_ape and mean_ape before and after calibrating on one measured GPU type)."""
    from rich.console import Console

    from daskpipe.profiles.accuracy import estimator_error
    from daskpipe.profiles.loader import load_profiles

    names = parse_names(models)
    if names is not None:
        names = list(load_profiles(profiles_dir, names))
    console = Console(stderr=True)
    with console.status("measuring FLOPs and bytes") as status:
        report = estimator_error(
            profiles_dir, names, parse_names(gpus), progress=lambda m: status.update(f"costing {m}"), calibrate=calibrate
        )
    text = json.dumps(report, indent=1)
    click.echo(text)
    if json_out:
        json_out.write_text(text)


@profile.command("show")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--model", "models", multiple=True, help="Model name or unique prefix (repeatable) [default: all].")
def show_command(path: Path, models: tuple[str, ...]) -> None:
    """A short table per model: whole-model latency and throughput per GPU type and slice count."""
    from rich.console import Console
    from rich.table import Table

    from daskpipe.profiles.loader import load_profiles

    console = Console()
    for name, prof in load_profiles(path, list(models) or None).items():
        table = Table(
            title=f"{name}: {prof.num_blocks} blocks, SLO {prof.slo_us / 1000:.2f} ms, "
            f"largest cut {max(prof.boundary_bytes, default=0) / 1e6:.2f} MB"
        )
        for column in ("GPU", "v", "batch 1 (ms)", "max batch", "at max (ms)", "req/s per slice"):
            table.add_column(column, justify="right")
        for gpu, v in sorted(prof.latency_us):
            top = prof.max_batch(gpu, v)
            at_top = prof.latency(gpu, v, top)
            table.add_row(
                gpu,
                str(v),
                f"{prof.latency(gpu, v, 1) / 1000:.2f}",
                str(top),
                f"{at_top / 1000:.2f}",
                f"{top / at_top * 1e6:.1f}" if at_top > 0 else "-",
            )
        console.print(table)


@profile.command("colocation")
@click.argument("models")
@click.option("--device", default="cuda", show_default=True, help="CUDA device whose MPS shares to profile on (the MPS daemon must run).")
@click.option(
    "--emulate",
    type=click.Choice(["inss-testbed"]),
    default=None,
    help="No GPU: run the campaign on this documented parameter set instead.",
)
@click.option("--gpu", "gpu_type", default=None, help="GPU type to label (with --emulate: one of the set's GPUs) [default: the device's].")
@click.option("--shares", default="0.24,0.42,0.6,1.0", show_default=True, help="MPS shares of the solo grid.")
@click.option("--batch-sizes", default="1,4,8,16", show_default=True, help="Batch sizes of the solo grid.")
@click.option("--co-sets", default=5, show_default=True, help="Co-located runs per model (1-3 random co-runners each).")
@click.option("--repeats", default=20, show_default=True, help="Timed batches per run on a GPU.")
@click.option("--noise", default=0.02, show_default=True, help="With --emulate: relative measurement noise.")
@click.option("--seed", default=0, show_default=True, help="Seeds the co-runner draws (and the emulated noise).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Fitted interference model (JSON) to write.")
def colocation_command(
    models: str,
    device: str,
    emulate: str | None,
    gpu_type: str | None,
    shares: str,
    batch_sizes: str,
    co_sets: int,
    repeats: int,
    noise: float,
    seed: int,
    out: Path,
) -> None:
    """Profile MODELS (comma-separated) alone and side by side on MPS shares of one GPU, fit InSS's
    interference model to the runs and write it with its fit error (docs/colocation.md)."""
    from rich.console import Console

    from daskpipe.profiles.profiler import profile_colocation

    try:
        share_list = [float(s) for s in shares.split(",")]
    except ValueError:
        raise click.BadParameter(f"{shares!r}: expected comma-separated fractions such as 0.25,0.5,1", param_hint="--shares") from None
    truth = None
    if emulate == "inss-testbed":
        from daskpipe.colocation.defaults import inss_testbed

        truth = inss_testbed()
    with Console(stderr=True).status(f"profiling {models} {'(emulated)' if truth else f'on {device}'}"):
        fitted, report = profile_colocation(
            parse_names(models) or [],
            device=device,
            emulate=truth,
            gpu_type=gpu_type,
            shares=share_list,
            batches=parse_batch_sizes(batch_sizes),
            co_sets=co_sets,
            noise=noise,
            repeats=repeats,
            seed=seed,
        )
    out.write_text(json.dumps({"interference": fitted.to_dict(), "fit": report.to_dict()}, indent=1))
    click.echo(
        f"wrote {out}: {len(fitted.coefficients)} (model, GPU) fits, error on the runs mean {report.mean_error_pct:.2f}%, max "
        f"{report.max_error_pct:.2f}%"
    )
