"""A run's per-step metrics as one PNG: a grid of small line plots, step on the x axis.

Panels, each only where the run has the metric: reward, KL, response length, loss, entropy, gradient norm,
and one per eval set (its mean reward and pass@1). Training metrics are indexed by the step they trained,
evaluations by the number of steps trained, as in the metrics table. NaN values are left out of a line.

matplotlib is imported on first use, with the non-interactive Agg backend, so importing this module costs
nothing (the CLI starts without it). Its font cache goes to `$MPLCONFIGDIR` when set, else to
`<sluiceway cache>/matplotlib`, else to a temporary directory: never to an unexpected place in $HOME.
"""

from __future__ import annotations

import base64
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

PANELS = [
    ("reward_mean", "reward"), ("train/kl", "KL"), ("response_len_mean", "response length"),
    ("train/loss", "loss"), ("train/entropy", "entropy"), ("train/grad_norm", "grad norm"),
]  # fmt: skip
CURVES_PNG = "curves.png"  # the file name in a run's output directory
EVAL_LINES = [("reward_mean", "reward"), ("pass@1", "pass@1")]
COLS = 3
PANEL_IN = (2.6, 1.8)  # inches per panel
DPI = 80
PALETTE = 64


def _series(frame: pd.DataFrame, col: str) -> tuple[list[int], list[float]]:
    s = frame[col]
    pairs = [(int(step), float(v)) for step, v in s.items() if v is not None and math.isfinite(float(v))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def panels(frame: pd.DataFrame) -> list[tuple[str, list[tuple[str, list[int], list[float]]]]]:
    """(title, [(line label, steps, values)]) for each panel that has at least one finite value."""
    out = []
    for col, title in PANELS:
        if col in frame:
            steps, vals = _series(frame, col)
            if vals:
                out.append((title, [(title, steps, vals)]))
    sets = sorted({c.split("/")[1] for c in frame if c.startswith("eval/") and c.count("/") >= 2})
    for name in sets:
        lines = []
        for suffix, label in EVAL_LINES:
            col = f"eval/{name}/{suffix}"
            if col in frame:
                steps, vals = _series(frame, col)
                if vals:
                    lines.append((label, steps, vals))
        if lines:
            out.append((f"eval {name}", lines))
    return out


def _matplotlib():
    if "MPLCONFIGDIR" not in os.environ:
        from sluiceway.infra.cache import cache_root

        d = cache_root() / "matplotlib"
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not os.access(d, os.W_OK):
                raise PermissionError(d)
        except OSError:
            d = Path(tempfile.gettempdir()) / f"sluiceway-matplotlib-{os.getuid()}"
            d.mkdir(parents=True, exist_ok=True)
        os.environ["MPLCONFIGDIR"] = str(d)
    import matplotlib

    matplotlib.use("Agg", force=True)
    return matplotlib


def figure(frame: pd.DataFrame, title: str = "") -> Figure | None:
    """The grid of panels as a matplotlib Figure (not attached to pyplot), or None when there is nothing to plot."""
    ps = panels(frame)
    if not ps:
        return None
    _matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(COLS, len(ps))
    nrows = math.ceil(len(ps) / ncols)
    size = (PANEL_IN[0] * ncols, PANEL_IN[1] * nrows + (0.3 if title else 0) + 0.2)
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (name, lines) in zip(axes.flat, ps):
        for label, steps, vals in lines:
            few = len(vals) <= 40
            ax.plot(steps, vals, marker="o" if few else None, markersize=2.5, linewidth=1.2, label=label)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
        ax.grid(True, linewidth=0.4, alpha=0.5)
        if len(lines) > 1:
            ax.legend(fontsize=6, loc="best", frameon=False)
    for ax in list(axes.flat)[len(ps) :]:
        ax.set_visible(False)
    fig.supxlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def png_bytes(frame: pd.DataFrame, title: str = "") -> bytes | None:
    """The figure as a compact PNG (a 64-colour palette: a third of the RGBA size, the same look), or None.

    Nothing time-dependent goes into the file: the same metrics give the same bytes.
    """
    import io

    fig = figure(frame, title)
    if fig is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image  # a dependency of matplotlib

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    buf = io.BytesIO()
    rgb.quantize(colors=PALETTE, method=Image.Quantize.MEDIANCUT).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def write_png(data: bytes, path: str | Path) -> Path:
    """Write `data` to `path` through a temporary file and a rename: a viewer never sees half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")
