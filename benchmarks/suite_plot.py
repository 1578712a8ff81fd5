"""The suite's plot: throughput against beam size per model, and time against output length (matplotlib)."""

from __future__ import annotations

from pathlib import Path


def plot(rows: list, sweep: list, sweep_label: str, path: Path, header: str, engines: tuple[str, ...]) -> str:
    """Throughput against beam size per model (its largest batch), and time against output length (the sweep)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (.venv/bin/pip install matplotlib)"
    palette = plt.get_cmap("tab20").colors  # 20 colours: one per engine (the default cycle repeats after 10)
    styles = {engine: {"color": palette[(2 * i) % 20 + (2 * i) // 20]} for i, engine in enumerate(engines)}
    styles["floor"] = {"color": "black", "linestyle": "--"}
    names = list(dict.fromkeys(r.model for r in rows))
    panels = len(names) + (1 if sweep else 0)
    figure, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    for axis, name in zip(axes[0], names, strict=False):
        mine = [r for r in rows if r.model == name]
        batch = max(r.batch for r in mine)
        mine = sorted((r for r in mine if r.batch == batch), key=lambda r: r.beams)
        for engine in engines:
            points = [(r.beams, r.tokens[engine] / r.seconds(engine)) for r in mine if r.seconds(engine)]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=engine, **styles[engine])
        axis.set_title(f"{name}, batch {batch}", fontsize=9)
        axis.set_xlabel("beam size")
        axis.set_ylabel("output tokens / s")
        axis.set_xticks(sorted({r.beams for r in mine}))
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    if sweep:
        axis = axes[0][-1]
        for engine in engines:
            points = [(length, r.seconds(engine)) for length, r in sweep if r.seconds(engine)]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=engine, **styles[engine])
        axis.set_title(sweep_label, fontsize=9)
        axis.set_xlabel("output length (new tokens)")
        axis.set_ylabel("seconds")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(header, fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return f"plot written to {path}"
