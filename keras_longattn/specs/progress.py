"""Progress display of a benchmark or suite run, on standard error.

The benchmark (``keras-longattn bench``) prints one line when a
configuration starts and one when it ends::

    [3/12] local n=8192 fwdbwd jax ...
    [3/12] local n=8192 fwdbwd jax ... 412 ms, peak 96.0 MiB

With ``rich`` importable the lines are coloured and, on a terminal, a spinner
runs while a configuration is measured. Without it the same
lines are printed as plain text. The LRA-style suite
(``keras-longattn lra``) prints its lines through :meth:`Progress.note`.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, TextIO

__all__ = ["Progress", "PlainProgress", "RichProgress", "SilentProgress", "make_progress",
           "describe_job", "describe_outcome"]

MIB = float(1 << 20)
GIB = float(1 << 30)


def describe_job(job: Mapping[str, Any]) -> str:
    """``local n=8192 fwdbwd jax``."""
    return f"{job['layer']} n={job['seq_len']} {job['mode']} {job['backend']}"


def describe_outcome(row: Mapping[str, Any]) -> str:
    """``412 ms, peak 96.0 MiB`` or ``oom: <reason>``."""
    status = row.get("status")
    if status == "ok":
        median = row.get("median_ms", float("nan"))
        text = f"{median:.0f} ms" if median >= 100 else f"{median:.3g} ms"
        peak = row.get("peak_memory_bytes")
        if isinstance(peak, (int, float)):
            text += f", peak {peak / MIB:.1f} MiB"
        return text
    message = row.get("message") or ""
    return f"{status}: {message}" if message else str(status)


class Progress:
    """Interface of the progress display (this base class shows nothing)."""

    def start(self, index: int, total: int, job: Mapping[str, Any]) -> None:
        """Configuration ``index`` (1-based) of ``total`` starts."""

    def finish(self, index: int, total: int, job: Mapping[str, Any], row: Mapping[str, Any]) -> None:
        """Configuration ``index`` ended with result ``row``."""

    def note(self, text: str) -> None:
        """A free-form message (warnings, file paths)."""

    def close(self) -> None:
        """The run is over."""


SilentProgress = Progress


class PlainProgress(Progress):
    """Plain text lines on a stream (standard error by default)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, index, total, job):
        if job.get("status") == "skipped":
            return
        self._print(f"[{index}/{total}] {describe_job(job)} ...")

    def finish(self, index, total, job, row):
        self._print(f"[{index}/{total}] {describe_job(job)} ... {describe_outcome(row)}")

    def note(self, text):
        self._print(text)


class RichProgress(Progress):
    """Coloured lines and, on a terminal, a spinner while a configuration runs."""

    _STYLES = {"ok": "green", "oom": "red", "timeout": "yellow", "error": "bold red",
               "skipped": "dim"}

    def __init__(self, stream: TextIO | None = None) -> None:
        from rich.console import Console

        self.console = Console(file=stream if stream is not None else sys.stderr,
                               highlight=False)
        self._status = None

    def start(self, index, total, job):
        if job.get("status") == "skipped":
            return
        label = f"[{index}/{total}] {describe_job(job)}"
        self.console.print(f"[bold]{_escape(label)}[/] ...", soft_wrap=True)
        if self.console.is_terminal:
            self._status = self.console.status(f"{_escape(label)} running", spinner="dots")
            self._status.start()

    def finish(self, index, total, job, row):
        if self._status is not None:
            self._status.stop()
            self._status = None
        style = self._STYLES.get(row.get("status"), "default")
        label = f"[{index}/{total}] {describe_job(job)}"
        self.console.print(
            f"[bold]{_escape(label)}[/] ... [{style}]{_escape(describe_outcome(row))}[/]",
            soft_wrap=True,
        )

    def note(self, text):
        self.console.print(_escape(text), soft_wrap=True)

    def close(self):
        if self._status is not None:
            self._status.stop()
            self._status = None


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def make_progress(enabled: bool = True, stream: TextIO | None = None,
                  use_rich: bool | None = None) -> Progress:
    """The progress display to use.

    Args:
        enabled: ``False`` shows nothing.
        stream: where to write (standard error by default).
        use_rich: ``None`` uses rich when importable, ``False`` never.
    """
    if not enabled:
        return Progress()
    if use_rich is not False:
        try:
            return RichProgress(stream)
        except ImportError:
            pass
    return PlainProgress(stream)
