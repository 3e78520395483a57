"""Progress on long CLI work (profiling, planning, simulation sweeps, benchmarks), on stderr so
that the JSON a command prints on stdout stays clean."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

Advance = Callable[..., None]
"""``advance(steps=1, note=None)``: count finished steps and say what is being done now."""


@contextmanager
def progress_bar(description: str, total: float | None) -> Iterator[Advance]:
    """A transient rich progress bar; ``total=None`` shows activity without a known end."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)

        def advance(steps: float = 1, note: str | None = None) -> None:
            progress.update(task, advance=steps, description=f"{description}: {note}" if note else description)

        yield advance


@contextmanager
def progress_rows(description: str, rows: list[str]) -> Iterator[Callable[[str, str, bool], None]]:
    """One transient rich row per item of work done at once (e.g. per GPU kind), each with its own
    state and time: ``update(row, note, finished)``."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True), transient=True
    ) as progress:
        tasks = {row: progress.add_task(f"{description} {row}: waiting", total=1) for row in rows}

        def update(row: str, note: str, finished: bool = False) -> None:
            progress.update(tasks[row], description=f"{description} {row}: {note}", completed=1 if finished else 0)

        yield update
