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
