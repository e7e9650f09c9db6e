"""Bar charts of the tables in benchmarks/README.md, drawn when the documentation is built.

The README is the record (each table comes from one run of a script in ``benchmarks/``); this
module only reads its Markdown tables, so a plot can never disagree with the table above it.
Used by ``benchmarks.md`` through Matplotlib's ``plot`` directive.
"""

from __future__ import annotations

import pathlib
import re

import matplotlib.pyplot as plt
import numpy as np

# The plot directive runs this file without __file__, from docs/ (plot_working_directory).
_DOCS = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
README = _DOCS.parent / "benchmarks" / "README.md"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _table_after(heading: str) -> list[list[str]]:
    """Rows (cells as text, header first) of the first Markdown table after ``heading``."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and heading in line)
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif seen:
            break
    if not rows:
        raise ValueError(f"no table after {heading!r} in {README}")
    return rows


def _first_number(cell: str) -> float:
    match = _NUMBER.search(cell.replace(",", ""))
    if match is None:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(match.group())


def _bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")


def cpu_core() -> None:
    """Milliseconds per op, torch's fastest pipeline against the core (124M parameters)."""
    rows = _table_after("`cpu_core.py`")[1:]
    labels, torch_ms, ours_ms = [], [], []
    for op, torch_cell, ours_cell, _ in rows:
        labels.append(op.split("(")[0].strip().replace(" cycle", "\ncycle"))
        torch_ms.append(min(_first_number(part.split("`")[-1]) for part in torch_cell.split(";")))
        ours_ms.append(_first_number(ours_cell))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    series = {"torch (fastest pipeline)": torch_ms, "ours": ours_ms}
    _bars(ax, labels, series, "ms (lower is better)")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("CPU, GPT-2-small shapes (124M parameters)")
    fig.tight_layout()


def keras_step() -> None:
    """Ours ÷ Keras's built-in accumulation per backend, per micro-batch and per epoch.

    The table's cells hold one ``optimizer wall (CPU) / model wall (CPU)`` pair per run,
    runs separated by ``;``: a bar is the median of the runs' wall-time ratios, its whiskers
    the smallest and largest. Rows with our default non-finite check only.
    """
    header, *rows = _table_after("`keras_step.py`")
    assert header[:2] == ["backend", "ours"] and len(header) == 4
    rows = [r for r in rows if r[1] == "default"]
    backends = [r[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, col, title in zip(
        axes,
        (2, 3),
        ("per micro-batch (662k parameters, k = 8)", "per epoch (digits-sized, k = 4)"),
    ):
        runs = {"GradientAccumulateOptimizer": [], "GradientAccumulateModel": []}
        for row in rows:
            pairs = [run.split("/") for run in row[col].split(";")]
            for i, name in enumerate(runs):
                runs[name].append([_first_number(pair[i]) for pair in pairs])
        x = np.arange(len(backends))
        width = 0.8 / len(runs)
        for i, (name, values) in enumerate(runs.items()):
            mid = [float(np.median(v)) for v in values]
            err = [
                [m - min(v) for m, v in zip(mid, values)],
                [max(v) - m for m, v in zip(mid, values)],
            ]
            ax.bar(
                x + (i - (len(runs) - 1) / 2) * width, mid, width, yerr=err, capsize=3, label=name
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, backends)
        ax.set_title(title, fontsize="medium")
    axes[0].set_ylabel("ours ÷ Keras built-in, wall time\n(lower is faster; 1 = built-in)")
    axes[0].legend(fontsize="small", loc="lower left")
    fig.suptitle("Keras 3 against gradient_accumulation_steps, per backend")
    fig.tight_layout()


def torch_distributed() -> None:
    """Milliseconds per cycle per strategy, 2 and 4 Gloo ranks."""
    header, *rows = _table_after("`torch_distributed.py`")
    ms_col = header.index("ms / cycle")
    strategies = list(dict.fromkeys(r[1].replace("*", "") for r in rows))
    worlds = sorted({r[0] for r in rows})
    series = {
        f"{w} ranks": [
            next(_first_number(r[ms_col]) for r in rows if r[0] == w and r[1].replace("*", "") == s)
            for s in strategies
        ]
        for w in worlds
    }
    fig, ax = plt.subplots(figsize=(8, 3.5))
    _bars(
        ax,
        [s.replace(", ", ",\n").replace(" + ", " +\n") for s in strategies],
        series,
        "ms per cycle (lower is better)",
    )
    ax.tick_params(axis="x", labelsize=6.5)
    ax.set_title("torch.distributed (Gloo), k = 4")
    fig.tight_layout()
