"""Samples done over time, one line per output or host, from status.json's bounded `history`.

matplotlib is optional (plots are for people at a desk, not for nodes): without it `--plot`
fails with a clear message and exit 2, everything else works.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from pathlib import Path


class PlotError(RuntimeError):
    """Cannot draw (matplotlib missing, nothing to draw, or the file cannot be written)."""


def plot_history(
    series: Mapping[str, Sequence[Sequence[float]]],
    path: str | Path,
    title: str,
    totals: Mapping[str, int | None] | None = None,
) -> Path:
    """Write a PNG of done-over-time for each named (time, done) history; dashed line at each total."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError(f"--plot needs matplotlib ({exc}); install it with `pip install matplotlib`") from exc
    drawn = {name: pts for name, pts in series.items() if pts}
    if not drawn:
        raise PlotError("no progress history to plot (status.json has no `history` points yet)")
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    try:
        for name, pts in sorted(drawn.items()):
            times = [_dt.datetime.fromtimestamp(float(t), _dt.UTC) for t, _ in pts]
            (line,) = ax.plot(times, [int(d) for _, d in pts], marker=".", markersize=3, label=name)
            total = (totals or {}).get(name)
            if total:
                ax.axhline(total, color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("time (UTC)")
        ax.set_ylabel("samples done")
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.autofmt_xdate()
        fig.tight_layout()
        out = Path(path)
        try:
            fig.savefig(out, format="png")
        except OSError as exc:
            raise PlotError(f"cannot write {out}: {exc}") from exc
        return out
    finally:
        plt.close(fig)
