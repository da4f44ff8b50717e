"""How commands talk: JSON documents, human text, progress only on a TTY."""

from __future__ import annotations

import json
import os
import sys

import click

from . import JSON_SCHEMA


def color_ok(stream=None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def progress(msg: str) -> None:
    if sys.stderr.isatty():
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
