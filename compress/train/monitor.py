"""Training metrics: the ``metrics.jsonl`` log and its PNG plots.

``RUN_DIR/metrics.jsonl`` holds one JSON object a line:

* train, one per optimizer step: ``{"step", "split": "train", "loss", "lr", "grad_norm",
  "tokens", "data_wait_s", "compute_s", "time_s", "param_change": {group: relative_change}}``;
  ``step`` counts optimizer steps (1 = after the first update), ``loss`` is the mean micro-batch
  loss of the step (before clipping or any update), ``lr`` the learning rate the update used,
  ``grad_norm`` the global L2 norm before clipping, ``tokens`` the cumulative non-padding input
  tokens seen over all ranks, ``data_wait_s`` / ``compute_s`` the seconds of this step spent
  waiting for batches / computing (forward, backward, optimizer), ``time_s`` seconds since the
  run started (wall clock, resumed runs continue the count), and ``param_change`` the relative
  size of this step's update per layer group, ``||w_after - w_before|| / ||w_before||`` (groups:
  ``embed``, ``layers.N``, ``norm``, ``lm_head``; LoRA runs: the adapter weights of each group).
  Recipes may add their own loss parts (``kd_loss``, ``ce_loss``, ``cos_loss``).
* a run stopped by a non-finite loss ends with ``{"step", "split": "train", "event": "nan",
  "loss", "grad_norm"}`` (no update was made at that step);
* validation: ``{"step", "split": "val", "loss"}``, token-weighted mean cross-entropy over the
  validation split; step 0 is the model before training.

Plots (matplotlib, Agg backend) go to ``RUN_DIR/plots/``: ``loss.png`` (train vs validation),
``grad_norm.png``, ``lr.png``, ``param_change.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.train.checkpoints import TrainingError
from engine.records import read_jsonl

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append-only ``metrics.jsonl`` writer and its plots; only the process with ``enabled``
    (rank 0) writes, the others' calls do nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled

    def append(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def reset(self) -> None:
        """Start a fresh log (a new, not resumed, run)."""
        if self.enabled:
            self.path.unlink(missing_ok=True)

    def plot(self) -> list[Path]:
        """``plot_metrics`` of the run (nothing on other ranks)."""
        return plot_metrics(self.run_dir) if self.enabled else []

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a resumed run rewrites them)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [line for line in self.read() if line["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file (a run directory or the file itself); none if it is missing.

    Raises:
        TrainingError: not UTF-8, or a line that is not JSON (names file:line).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    return read_jsonl(path, error=TrainingError)


def plot_metrics(run_dir: str | Path) -> list[Path]:
    """Write the four PNG plots of a run's metrics; returns their paths (none without metrics)."""
    import matplotlib  # the bench extra (pip install 'lmforge[bench]')

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("split") == "train" and "event" not in r]
    val = [r for r in records if r.get("split") == "val"]
    if not train and not val:
        return []
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def figure(name: str, ylabel: str, draw, log: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        paths.append(out / f"{name}.png")

    def loss(ax) -> None:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
        ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="validation")
        ax.legend()

    figure("loss", "loss (cross-entropy, nats/token)", loss)

    def grad(ax) -> None:
        pts = [(r["step"], r["grad_norm"]) for r in train if r["grad_norm"] > 0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])

    figure("grad_norm", "gradient norm (before clipping)", grad, log=True)
    figure("lr", "learning rate", lambda ax: ax.plot([r["step"] for r in train], [r["lr"] for r in train]))

    def change(ax) -> None:
        steps = [r for r in train if r.get("param_change")]
        groups = sorted({g for r in steps for g in r["param_change"]}, key=_group_order)
        cmap = plt.get_cmap("viridis", max(len(groups), 2))
        for k, group in enumerate(groups):
            pts = [(r["step"], r["param_change"][group]) for r in steps if r["param_change"].get(group, 0) > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=cmap(k), lw=1, label=group)
        if groups:
            ax.legend(fontsize=6, ncol=max(1, len(groups) // 12), loc="upper right")

    figure("param_change", "relative update ||dw|| / ||w||", change, log=True)
    return paths


def _group_order(name: str) -> tuple[int, int, str]:
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]), name)
    return ({"embed": 0, "norm": 2, "lm_head": 3}.get(name, 4), 0, name)
