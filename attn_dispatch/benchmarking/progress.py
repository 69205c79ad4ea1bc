"""A progress bar: rich's when it is installed and stderr is a terminal, else one plain line per step."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def progress(total: int, description: str, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yields advance(label): call it after each finished step."""
    if not enabled:
        yield lambda label: None
        return
    bar = _rich_progress() if sys.stderr.isatty() else None
    if bar is None:
        yield _plain(total, description)
        return
    with bar:
        task = bar.add_task(description, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{description}: {label}")
        yield advance


def _rich_progress():
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False)


def _plain(total: int, description: str) -> Callable[[str], None]:
    done = 0
    started = time.perf_counter()

    def advance(label: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{total} {time.perf_counter() - started:6.1f}s] {description}: {label}", file=sys.stderr,
              flush=True)
    return advance
