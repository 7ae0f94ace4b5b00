"""Draw the benchmark page's plots (docs/benchmarks/*.png) from the figures in docs/benchmarks.json.

    .venv/bin/python scripts/bench_plots.py

One horizontal bar chart per benchmark, its rows in the order the JSON gives them, each bar labelled
with its figure. The PNGs are committed: the docs build needs neither the benchmarks nor a display.
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "benchmarks.json")
OUT = os.path.join(ROOT, "docs", "benchmarks")


def plot(name: str, entry: dict) -> str:
    """One benchmark's bars, saved as docs/benchmarks/NAME.png; returns the path."""
    labels, values = list(entry["rows"]), list(entry["rows"].values())
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(labels)), dpi=110)
    bars = ax.barh(labels[::-1], values[::-1], color="#3b6fd8")
    ax.bar_label(bars, labels=[f"{v:g} {entry['unit']}" for v in values[::-1]], padding=3, fontsize=9)
    ax.set_title(entry["title"], fontsize=11)
    ax.set_xlabel(entry["unit"])
    ax.set_xlim(0, max(values) * 1.25)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    path = os.path.join(OUT, f"{name}.png")
    # No version stamp: the same figures give the same file.
    fig.savefig(path, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def main() -> None:
    with open(DATA, encoding="utf-8") as fh:
        data = json.load(fh)
    os.makedirs(OUT, exist_ok=True)
    for name, entry in data.items():
        if not name.startswith("_"):
            print(os.path.relpath(plot(name, entry), ROOT))


if __name__ == "__main__":
    main()
