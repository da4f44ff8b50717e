"""How commands talk: JSON documents, human text, progress only on a TTY.  Output is
best effort: a closed or broken stream (``2>&-``, ``| head``) is not an error."""

from __future__ import annotations

import io
import json
import os
import sys

import click

from . import JSON_SCHEMA


class _Sink(io.RawIOBase):
    """A file descriptor that drops what it cannot write (a closed pipe's reader)."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd, self.dead = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, b) -> int:
        if not self.dead:
            try:
                return os.write(self.fd, b)
            except OSError:
                self.dead = True
        return len(b)


def guard_streams() -> None:
    """Closed descriptors 0-2 get /dev/null (so no file this run opens takes their
    number), and stdout / stderr write through a ``_Sink``."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue  # None (closed at start) or not a real file (a test's capture)
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        if not isinstance(getattr(getattr(stream, "buffer", None), "raw", None), _Sink):
            setattr(sys, name, io.TextIOWrapper(
                io.BufferedWriter(_Sink(fd)), encoding=stream.encoding,
                errors=stream.errors, line_buffering=stream.line_buffering))


def color_ok(stream=None) -> bool:
    stream = stream or sys.stdout
    return stream is not None and stream.isatty() and not os.environ.get("NO_COLOR")


def progress(msg: str) -> None:
    if sys.stderr is not None and sys.stderr.isatty():
        click.echo(f"· {msg}", err=True)


def emit_json(command: str, exit_code: int, payload: dict) -> None:
    doc = {"schema": JSON_SCHEMA, "command": command, "ok": exit_code == 0,
           "exit_code": exit_code}
    doc.update(payload)
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


def emit_next(hint: str) -> None:
    click.echo(f"next: {hint}", err=True)


def emit_error(err) -> None:
    head = click.style("error:", fg="red", bold=True) if color_ok(sys.stderr) else "error:"
    click.echo(f"{head} {err.message}", err=True)
    for d in err.details:
        if isinstance(d, dict):
            click.echo("  - " + ", ".join(f"{k}: {v}" for k, v in d.items()), err=True)
        else:
            click.echo(f"  - {d}", err=True)
    emit_next(err.hint or "see `ddtree-patch --help`")


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
