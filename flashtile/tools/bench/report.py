"""Turning a run into files: the table (text and Markdown), the Markdown page, the optional plot.

The subcommands build their own Table (their columns differ); this module only renders and writes,
so it imports nothing from them.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import sys
from pathlib import Path
from typing import Callable


@dataclasses.dataclass
class Table:
    """One summary table: header, rows of strings, notes printed under it."""

    header: list[str]
    rows: list[list[str]]
    notes: list[str]
    left: frozenset = frozenset({"causal", "mode", "ok", "layout"})  # columns aligned left


def render_text(table: Table) -> str:
    """The table as aligned plain text (for the log), followed by its notes."""
    widths = [max([len(name)] + [len(row[i]) for row in table.rows]) for i, name in enumerate(table.header)]

    def line(cells):
        return "  ".join(cell.ljust(width) if name in table.left else cell.rjust(width)
                         for cell, width, name in zip(cells, widths, table.header)).rstrip()

    return "\n".join([line(table.header), *(line(row) for row in table.rows), *table.notes])


def render_markdown(table: Table) -> str:
    """The table as GitHub Markdown, followed by its notes as a list."""
    align = [":---" if name in table.left else "---:" for name in table.header]
    lines = ["| " + " | ".join(table.header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    if table.notes:
        lines.append("")
        lines += [f"- {note}" for note in table.notes]
    return "\n".join(lines)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def environment_lines(meta: dict) -> list[str]:
    """The Markdown bullet lines every results page starts with."""
    dirty = " (dirty)" if meta.get("flashtile_dirty") else ""
    device = f"GPU: {meta['gpu']} ({meta['sm_count']} SMs)" if meta.get("gpu") else f"device: {meta['device']}"
    lines = [
        f"- {device}",
        f"- date (UTC): {meta['date_utc']}",
        f"- flashtile {meta.get('flashtile_version')}, commit {meta.get('flashtile_commit') or 'unknown'}{dirty}",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
        f"Python {meta['python']}",
        f"- command: `{shlex.join(['python', *meta['command']])}`",
    ]
    anchors = meta.get("anchors") or {}
    if anchors:
        lines.append("- anchors (same run): " + "; ".join(f"{name}: {status}" for name, status in anchors.items()))
    return lines


def write_markdown(path: Path, title: str, meta: dict, details: list[str], table: Table) -> None:
    """A results page: title, environment, the mode's own details, the table."""
    lines = [f"# {title}", "", *environment_lines(meta), *details, "", render_markdown(table)]
    path.write_text("\n".join(lines) + "\n")


def matplotlib_pyplot():
    """pyplot on the Agg backend, or None when matplotlib is not installed (the plot is optional)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def skipped_notes(pairs) -> list:
    """One note per (system, reason) of the skipped points, with their count: ``pairs`` yields
    (system, reason or None) per record."""
    counts: dict = {}
    for system, reason in pairs:
        if reason:
            counts[(system, reason)] = counts.get((system, reason), 0) + 1
    return [f"skipped {system} x{count}: {reason}" for (system, reason), count in counts.items()]


def save_plot(draw: Callable[[object], object], path: Path, rect=None) -> str:
    """``draw(pyplot)`` returns a figure, saved to ``path`` (laid out within ``rect``) and closed;
    returns what happened, for the log and the JSON (never raises)."""
    plt = matplotlib_pyplot()
    if plt is None:
        message = f"no {path.name}: matplotlib is not installed (pip install matplotlib)"
    else:
        try:
            fig = draw(plt)
            fig.tight_layout(**({"rect": rect} if rect else {}))
            fig.savefig(path, dpi=120)
            plt.close(fig)
            return f"wrote {path.name}"
        except Exception as exc:  # the numbers matter more than the plot
            message = f"no {path.name}: {type(exc).__name__}: {exc}"
    print(message, file=sys.stderr, flush=True)
    return message


def grouped_bars(records: list[dict], systems: list[str], group_of: Callable[[dict], tuple],
                 label_of: Callable[[tuple], str], ylabel: str, title: str, group_width: float = 1.6,
                 label_size: int = 8) -> Callable[[object], object]:
    """A save_plot drawing: one bar per system in each group of records (group_of(record), sorted),
    the bar's height the record's TFLOP/s (0 when absent)."""

    def draw(plt):
        groups = sorted({group_of(r) for r in records})
        fig, ax = plt.subplots(figsize=(max(6, group_width * len(groups)), 4))
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [next((r["tflops"] or 0 for r in records if r["system"] == system and group_of(r) == g), 0)
                      for g in groups]
            ax.bar([x + i * width for x in range(len(groups))], values, width, label=system)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
        ax.set_xticklabels([label_of(g) for g in groups], fontsize=label_size)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        return fig

    return draw
