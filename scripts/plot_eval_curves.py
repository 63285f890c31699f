"""Held-out accuracy of one or more runs against wall seconds, in one PNG, and the figures.

    python scripts/plot_eval_curves.py --run SFT=outputs/sft_addition --run GRPO=outputs/grpo_addition \\
        --out docs/img/sft_then_grpo.png

Each run is an app's ``logging.output_dir``; its ``metrics.jsonl`` rows that hold an evaluation
give one point each, at the row's ``wall_s`` (seconds since that run started). Runs are drawn one
after the other on the time axis, as they ran. Prints one JSON line: each run's first and last
accuracy, its mean of the last three evaluations and its wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def evaluations(folder: Path, key: str) -> list[tuple[float, float]]:
    """(wall seconds, value) of every evaluation of the run in ``folder``."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["wall_s"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "wall_s" in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="LABEL=OUTPUT_DIR, in the order they ran")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--key", default="eval/accuracy", help="the evaluation figure to draw")
    args = parser.parse_args(argv)
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    offset, figures = 0.0, {}
    for spec, color in zip(args.run, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        label, _, folder = spec.partition("=")
        points = evaluations(Path(folder), args.key)
        if not points:
            print(f"{folder}: no evaluation with {args.key!r} in metrics.jsonl", file=sys.stderr)
            return 1
        xs = [offset + t for t, _ in points]
        ys = [v for _, v in points]
        ax.plot(xs, ys, color=color, marker="o", markersize=3, label=label)
        last3 = ys[-3:]
        figures[label] = {
            "first": ys[0],
            "last": ys[-1],
            "mean_last_3": sum(last3) / len(last3),
            "wall_s": points[-1][0],
        }
        offset = xs[-1]
    ax.set_xlabel("wall seconds (each run from its own start, one after the other)")
    ax.set_ylabel(f"held-out {args.key.removeprefix('eval/')}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    print(json.dumps({"plot": str(out), **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
