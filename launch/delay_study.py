"""AdamW vs Muon under a one-step gradient delay (PipeDream-2BW's staleness), with and without the
error-feedback correction: six runs of one config, same seed, data and steps.

    python launch/delay_study.py --config=configs/quickstart.py --workdir=runs/delay_study \
        [--config.train.steps=400 ...]

Each run trains in WORKDIR/<optimizer>-<variant> (rerunning resumes / skips finished runs); the study
writes WORKDIR/delay_study.md (a Markdown table: final train loss averaged over the last logged tenth of
the run, eval loss, and the gap to the same optimizer without delay) and WORKDIR/delay_study.png (loss
curves). Every run uses the config's learning rate: Muon's updates are scaled to AdamW's RMS
(`optim.muon.scale=rms`), so one lr serves both.
"""

import json
import os


from launch.common import cli_main

OPTIMIZERS = ("adamw", "muon")
VARIANTS = (("no delay", 0, "none"), ("delay 1", 1, "none"), ("delay 1 + error feedback", 1, "error_feedback"))


def _runs(config):
    for name in OPTIMIZERS:
        for label, delay, correction in VARIANTS:
            run = config.copy_and_resolve_references()
            run.optim.update(name=name, grad_delay=delay, delay_correction=correction)
            yield name, label, run, f"{name}-delay{delay}-{correction}"


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(results, steps) -> str:
    """results: {(optimizer, variant label): metrics records} -> the Markdown table."""
    lines = [f"| optimizer | gradient delay | train loss (last 10% of {steps} steps) | eval loss | "
             f"eval gap to no delay |", "|---|---|---|---|---|"]
    for name in OPTIMIZERS:
        base = None
        for label, _, _ in VARIANTS:
            records = results[(name, label)]
            tail = [r["loss"] for r in records if r["step"] > steps * 0.9] or [records[-1]["loss"]]
            evals = [r["eval_loss"] for r in records if "eval_loss" in r]
            final = evals[-1] if evals else float("nan")
            base = final if base is None else base
            gap = "" if label == VARIANTS[0][0] else f"{final - base:+.4f}"
            lines.append(f"| {name} | {label} | {sum(tail) / len(tail):.4f} | {final:.4f} | {gap} |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPTIMIZERS), figsize=(6 * len(OPTIMIZERS), 4), sharey=True)
    for ax, name in zip(axes, OPTIMIZERS):
        for (label, _, _), style in zip(VARIANTS, ("-", "--", ":")):
            records = results[(name, label)]
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], style, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("train loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(config, flags):
    from parallax.train import train_and_evaluate

    results = {}
    for name, label, run_config, subdir in _runs(config):
        workdir = os.path.join(flags.workdir, subdir)
        print(f"--- {name}, {label}: {workdir}", flush=True)
        last = lambda line: print(line, flush=True) if "eval_loss" in line else None  # keep the log short
        train_and_evaluate(run_config, workdir, log=last)
        results[(name, label)] = _records(workdir)
    table = summarize(results, int(config.train.steps))
    with open(os.path.join(flags.workdir, "delay_study.md"), "w") as f:
        f.write(table + "\n")
    plot(results, os.path.join(flags.workdir, "delay_study.png"))
    print(table)
    print(f"wrote {flags.workdir}/delay_study.md and delay_study.png")



def cli():
    """The `parallax-delay-study` console script (pyproject.toml); also `python launch/delay_study.py`."""
    cli_main(run, needs_config=True)


if __name__ == "__main__":
    cli()
