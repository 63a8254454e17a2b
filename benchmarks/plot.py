"""Plots of a benchmark CSV from ``bench_attention.py``: time and peak memory vs N, log-log.

    python benchmarks/plot.py docs/results/bench_attention.csv --out-dir docs/results

writes one PNG per (head_dim, causal): a row of time panels (one per workload) and a memory panel.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r["status"] == "ok"]


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    groups = defaultdict(list)
    for r in rows:
        groups[(int(r["head_dim"]), r["causal"] == "True", r.get("dtype", "bfloat16"), int(r["heads"]))].append(r)
    written = []
    for (head_dim, causal, dtype, heads), group in sorted(groups.items()):
        workloads = sorted({r["workload"] for r in group}, key=["fwd", "fwd_bwd", "bob", "fwd_bwd_bob"].index)
        fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(4 * (len(workloads) + 1), 3.6))
        # one colour per implementation in every panel (sdpa_flash/sdpa_cudnn have no BoB points)
        colors = {impl: f"C{i}" for i, impl in enumerate(sorted({r["impl"] for r in rows}))}
        for ax, workload in zip(axes, workloads):
            for impl in sorted({r["impl"] for r in group}):
                pts = sorted((int(r["n"]), float(r["ms"])) for r in group if r["impl"] == impl and r["workload"] == workload)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, color=colors[impl])
            ax.set(xscale="log", yscale="log", title=workload, xlabel="N", ylabel="ms")
            ax.grid(True, which="both", alpha=0.3)
        for impl in sorted({r["impl"] for r in group}):
            pts = sorted((int(r["n"]), float(r["peak_gib"])) for r in group if r["impl"] == impl and r["workload"] == "fwd_bwd_bob"
                         and r["peak_gib"])  # no memory figure in --device cpu rows
            if pts:
                axes[-1].plot(*zip(*pts), marker="o", label=impl, color=colors[impl])
        axes[-1].set(xscale="log", yscale="log", title="peak memory, fwd_bwd_bob", xlabel="N", ylabel="GiB")
        axes[-1].grid(True, which="both", alpha=0.3)
        handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}  # every impl, even one without fwd
        axes[0].legend([handles[i] for i in sorted(handles)], sorted(handles))
        fig.suptitle(f"{dtype}, H={heads}, d={head_dim}, {'causal' if causal else 'non-causal'}")
        fig.tight_layout()
        others = [k for k in groups if k[:2] == (head_dim, causal) and k != (head_dim, causal, dtype, heads)]
        suffix = f"_{dtype}_h{heads}" if others else ""  # the usual one file per (d, causal) unless a sweep mixes
        path = out_dir / f"bench_d{head_dim}_{'causal' if causal else 'full'}{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out-dir", default="docs/results")
    args = parser.parse_args()
    for path in plot(load(args.csv), Path(args.out_dir)):
        print("wrote", path)


if __name__ == "__main__":
    main()
