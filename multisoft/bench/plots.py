"""PNG plots of a benchmark run (matplotlib, imported only here): GB/s over the sweep of row lengths, and the
forward+backward fraction of copy at the headline shapes and layouts."""

from __future__ import annotations

from pathlib import Path

from .plan import DIRECTIONS
from .cells import impl_order as _impls


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sweep_plot(op: str, timings, copy_gb_per_s: float | None, path: Path) -> Path | None:
    """GB/s against N, one panel per (dtype, direction), one line per impl, the copy as a dashed line."""
    rows = [t for t in timings if t.op == op and "sweep" in t.group and t.gb_per_s]
    if not rows:
        return None
    plt = _pyplot()
    dtypes = list(dict.fromkeys(t.dtype for t in rows))
    impls = _impls(rows)
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(dtypes), len(DIRECTIONS), figsize=(5 * len(DIRECTIONS), 3.6 * len(dtypes)),
                             squeeze=False, sharex=True)
    for i, dtype in enumerate(dtypes):
        for j, direction in enumerate(DIRECTIONS):
            ax = axes[i][j]
            for impl in impls:
                points = sorted((t.n, t.gb_per_s) for t in rows
                                if t.dtype == dtype and t.direction == direction and t.impl == impl)
                if points:
                    xs, ys = zip(*points)
                    style = "--" if any(t.role == "peer" for t in rows if t.impl == impl) else "-"
                    ax.plot(xs, ys, style, marker="o", markersize=3, color=colors[impl], label=impl)
            if copy_gb_per_s:
                ax.axhline(copy_gb_per_s, color="black", linestyle=":", linewidth=1, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{op} {dtype} {direction}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("GB/s")
            if i == len(dtypes) - 1:
                ax.set_xlabel("N (row length), M·N fixed")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 8), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def headline_bars(timings, path: Path, direction: str = "forward+backward") -> Path | None:
    """Fraction of copy at the headline shapes and layouts: one panel per (op, dtype), bars per impl."""
    rows = [t for t in timings if t.direction == direction and t.group != "sweep" and t.role != "copy"
            and t.fraction_of_copy is not None]
    if not rows:
        return None
    plt = _pyplot()
    panels = list(dict.fromkeys((t.op, t.dtype) for t in rows))
    impls = _impls(rows)
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    for ax, (op, dtype) in zip(axes[:, 0], panels):
        panel = [t for t in rows if t.op == op and t.dtype == dtype]
        shapes = list(dict.fromkeys(t.shape for t in panel))
        present = [impl for impl in impls if any(t.impl == impl for t in panel)]
        width = 0.8 / max(1, len(present))
        for k, impl in enumerate(present):
            values = {t.shape: t.fraction_of_copy for t in panel if t.impl == impl}
            xs = [s + (k - (len(present) - 1) / 2) * width for s in range(len(shapes))]
            ax.bar(xs, [values.get(shape, 0.0) for shape in shapes], width, color=colors[impl], label=impl)
        ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
        ax.set_ylim(0, max(1.25, 1.2 * max(t.fraction_of_copy for t in panel)))
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, fontsize=8, rotation=20 if len(shapes) > 6 else 0,
                           ha="right" if len(shapes) > 6 else "center")
        ax.set_ylabel("fraction of copy")
        ax.set_title(f"{op} {dtype} {direction}", fontsize=10)
        ax.legend(fontsize=7, ncol=len(present), loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results, out: Path) -> list[Path]:
    """The sweep plot of each op that has a sweep, and the headline bar chart; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    ops = list(dict.fromkeys(t.op for t in results.timings))
    paths = [sweep_plot(op, results.timings, results.copy_gb_per_s, out / f"sweep_{op}.png") for op in ops]
    paths.append(headline_bars(results.timings, out / "fraction_of_copy.png"))
    return [p for p in paths if p is not None]
