"""Metrics to `metrics.jsonl`, W&B (through Accelerate's tracker) and PNG plots in the run dir."""

from __future__ import annotations

import json
import logging
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from drafters.config.errors import UserError  # noqa: E402
from drafters.storage.writes import atomic_file, no_space, out_of_space  # noqa: E402

log = logging.getLogger("training")


class MetricsLog:
    def __init__(self, accelerator, run_dir: str):
        self.accelerator = accelerator
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.plots_dir = os.path.join(run_dir, "plots")

    def log(self, step: int, values: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        record = {"step": step, **values}
        try:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        except OSError as error:  # a torn line is left out when the run resumes
            if out_of_space(error):
                raise no_space("metrics", self.path, "the checkpoints are intact: free some space and rerun with "
                               "trainer.resume=auto") from None
            raise
        self.accelerator.log(values, step=step)

    def truncate_after(self, step: int) -> None:
        """At the start: drop what a killed run logged past its last checkpoint (or before any), so
        that steps stay unique and the curves are this run's."""
        if not self.accelerator.is_main_process or not os.path.exists(self.path):
            return
        kept = [r for r in self.records() if r["step"] <= step]
        with atomic_file(self.path, key="metrics") as partial, open(partial, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)

    def records(self) -> list[dict]:
        """Every record logged; a torn last line (a kill or a full disk while appending) is left out."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as handle:
            lines = [line for line in handle.read().decode("utf-8", "replace").split("\n")]
        found = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("not a record with a step")
            except ValueError as error:
                if number == len(lines):  # no newline after it: it was being written
                    log.warning("%s: line %d is torn (%s); left out", self.path, number, error)
                    continue
                raise UserError(f"{self.path}:{number}: not a metrics record ({error}); remove that line to go on") from None
            found.append(record)
        return found

    def plot(self) -> None:
        """loss.png, acceptance_by_position.png, sim_accept_len.png from everything logged so far."""
        if not self.accelerator.is_main_process:
            return
        os.makedirs(self.plots_dir, exist_ok=True)
        records = self.records()

        def series(key):
            points = [(r["step"], r[key]) for r in records if key in r]
            return [p[0] for p in points], [p[1] for p in points]

        def figure(name, title, keys, ylabel):
            fig, ax = plt.subplots(figsize=(7, 4))
            for key, label in keys:
                steps, values = series(key)
                if steps:
                    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=label)
            ax.set(title=title, xlabel="step", ylabel=ylabel)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            fig.tight_layout()
            with atomic_file(os.path.join(self.plots_dir, name), key="plots") as partial:
                fig.savefig(partial, dpi=100, format="png")
            plt.close(fig)

        figure("loss.png", "loss", [("train/loss", "train"), ("eval/loss", "eval")], "weighted TTT loss")
        positions = sorted({int(k.split("/")[-1]) for r in records for k in r if k.startswith("eval/acc/")})
        figure(
            "acceptance_by_position.png",
            "eval top-1 agreement with the target, by draft position",
            [(f"eval/acc/{k}", f"position {k}") for k in positions],
            "accuracy",
        )
        figure("sim_accept_len.png", "simulated acceptance length", [("eval/sim_accept_len", "eval")], "tokens / target forward")
