"""Showing a diagnosis: `diagnosis.json` for tools, a short block on the terminal for people.

The terminal block reads in ten seconds: the verdict, one line per rank (where it is, what it
waits for), then what to change. Warnings of a healthy run get one short block each.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from gradsync.rundir import RunDir, write_json

WIDTH = 100
TRACEBACK_LINES = 20


def write(diagnosis: dict[str, Any], run_dir: Path) -> Path:
    run = RunDir(run_dir)
    write_json(run.diagnosis, diagnosis)
    attempt = diagnosis.get("attempt")
    if attempt is not None:
        write_json(run.attempt_diagnosis(attempt), diagnosis)
    return run.diagnosis


def _wrapped(text: str, indent: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def render(diagnosis: dict[str, Any], path: Path | None = None) -> str:
    findings = diagnosis["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    warnings = [f for f in findings if f["severity"] == "warning"]
    lines = []
    if errors:
        first = errors[0]
        ranks = ", ".join(str(r) for r in first["ranks"])
        lines.append(f"gradsync run: FAILED: {first['category']} (rank{'s' if len(first['ranks']) > 1 else ''} {ranks})")
        lines.append(_wrapped(first["message"], "  "))
        lines += _traceback_lines(first)
        for rank, line in sorted(diagnosis.get("ranks", {}).items(), key=lambda item: int(item[0])):
            lines.append(_wrapped(f"rank {rank}: {line}", "  "))
        lines.append(_wrapped(f"fix: {first['suggestion']}", "  "))
        for other in errors[1:]:
            lines.append(_wrapped(f"also {other['category']}{_ranks(other)}: {other['message']}", "  "))
    elif diagnosis.get("status") == "failed":  # no worker got far enough to be diagnosed
        lines.append(_wrapped(f"gradsync run: FAILED: {diagnosis.get('note') or 'the workers failed'}", ""))
    else:
        ranks = diagnosis.get("ranks", {})
        verdict = f"ok: {len(ranks)} rank{'s' if len(ranks) != 1 else ''} finished"
        if warnings:
            verdict += f", {len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
        lines.append(f"gradsync run: {verdict}")
    for warning in warnings:
        lines.append(_wrapped(f"warning: {warning['category']}{_ranks(warning)}: {warning['message']}", "  "))
        lines.append(_wrapped(f"fix: {warning['suggestion']}", "    "))
    if path is not None:
        lines.append(f"  diagnosis: {path}")
        if errors and diagnosis.get("attempt") is not None:
            # Where each rank's own output went: backend log lines, tracebacks (gradsync.run.output).
            lines.append(f"  rank logs: {RunDir(path.parent).log(diagnosis['attempt'], 0).with_name('rank*.log')}")
    return "\n".join(lines)


def _traceback_lines(finding: dict[str, Any]) -> list[str]:
    """The end of the failing rank's traceback: the workers print none (every rank's would pile
    up, the consequences' included), so the cause's is shown here, once."""
    details = finding.get("details") or {}
    if not details.get("traceback"):
        return []
    lines = details["traceback"].rstrip().splitlines()
    shown = lines[-TRACEBACK_LINES:]
    head = f"  traceback of rank {details.get('traceback_rank', '?')}"
    head += f" (last {len(shown)} of {len(lines)} lines):" if len(shown) < len(lines) else ":"
    return [head, *("    " + line for line in shown)]


def publish(diagnosis: dict[str, Any], run_dir: Path) -> None:
    """Write the diagnosis and print it to stderr (where torchrun prints its own errors)."""
    path = write(diagnosis, run_dir)
    print(render(diagnosis, path), file=sys.stderr, flush=True)


def _ranks(finding: dict[str, Any]) -> str:
    """' (ranks [0, 1])' after a finding's category; nothing for one about the job as a whole."""
    return f" (ranks {finding['ranks']})" if finding["ranks"] else ""
