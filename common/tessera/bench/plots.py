"""PNG charts of sweeps: throughput against the swept setting, and median / p99 TTFT and TPOT
against output throughput; several sweep files (ours, vLLM's) as series of one chart."""
from __future__ import annotations

import json
import pathlib

SWEEP_AXES = {"max_concurrency": "max concurrency (requests in flight)", "request_rate": "request rate (req/s)"}


def load_sweep(path: str) -> dict:
    """A sweep file: {"label", "sweep", "runs": [figures, ...]}."""
    data = json.loads(pathlib.Path(path).read_text())
    if "runs" not in data or data.get("sweep") not in SWEEP_AXES:
        raise ValueError(f"{path}: not a sweep result (tessera bench --sweep-... --save-result writes one)")
    return data


def draw(sweeps: list[dict], out_dir: str, prefix: str = "sweep") -> list[pathlib.Path]:
    """Write <prefix>_throughput.png and <prefix>_latency.png; return their paths."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    axis = sweeps[0]["sweep"]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, sweep in enumerate(sweeps):
        runs = sweep["runs"]
        ax.plot([r[sweep["sweep"]] for r in runs], [r["output_throughput"] for r in runs], marker="o",
                color=f"C{i}", label=sweep["label"])
    ax.set_xlabel(SWEEP_AXES[axis])
    ax.set_ylabel("output throughput (tok/s)")
    if axis == "max_concurrency":
        ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("Throughput")
    fig.tight_layout()
    paths.append(out / f"{prefix}_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for i, sweep in enumerate(sweeps):
            runs = sweep["runs"]
            x = [r["output_throughput"] for r in runs]
            for stat, style in (("median", "-"), ("p99", "--")):
                key = f"{stat}_{metric}_ms"
                if all(key in r for r in runs):
                    y = [r[key] for r in runs]
                    ax.plot(x, y, style, color=f"C{i}", marker="o", label=f"{sweep['label']} {stat}")
                    if stat == "median":  # which setting each point is
                        for xi, yi, r in zip(x, y, runs):
                            ax.annotate(f"{r[sweep['sweep']]:g}", (xi, yi), textcoords="offset points",
                                        xytext=(4, -10), fontsize=7, color=f"C{i}")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} against throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out / f"{prefix}_latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
