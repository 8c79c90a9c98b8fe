"""Draws a schedule's timeline: text for a terminal, PNG (matplotlib) for a notebook or a README.

Cells: `F3` forward of microbatch 3, `B3` input-gradient backward, `W3` weight-gradient backward, `X3`
fused backward (BW), `.` idle. When a rank holds several chunks, a letter names the local chunk:
`F3a` is chunk 0, `F3b` chunk 1, and so on. `F7a+X3b`: a tick that runs two actions overlapped (dualpipev).
"""
import dataclasses

import numpy as np

from parallax.pipeline.schedule import IDLE, Schedule, unroll
from parallax.pipeline.simulate import simulate, steady_bubbles

_CELL = ("", "F", "B", "W", "X")
_COLORS = ("white", "#4c72b0", "#dd8452", "#55a868", "#c44e52")  # idle, F, B, W, BW
_LEGEND = ("idle", "F forward", "B input grad", "W weight grad", "X fused backward")


def _label(schedule: Schedule, cell) -> str:
    kind, mb, chunk, _ = (int(x) for x in cell)
    if kind == IDLE:
        return "."
    return f"{_CELL[kind]}{mb}" + (chr(ord("a") + chunk) if schedule.num_chunks > 1 else "")


def _tick_label(schedule: Schedule, t, r) -> str:
    """The label of rank r's tick t: `F7a+X3b` where a tick pairs two actions (`Schedule.pair`)."""
    label = _label(schedule, schedule.table[t, r])
    if schedule.pair is not None and schedule.pair[t, r, 0] != IDLE:
        label += "+" + _label(schedule, schedule.pair[t, r])
    return label


def render_text(schedule: Schedule) -> str:
    """One row per rank, one column per tick; see the module docstring for the cell legend."""
    labels = [[_tick_label(schedule, t, r) for t in range(schedule.num_ticks)]
              for r in range(schedule.num_ranks)]
    width = max((len(x) for row in labels for x in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(x.rjust(width) for x in row) for r, row in enumerate(labels))


def render_png(schedule: Schedule, path: str, costs: dict | None = None) -> None:
    """Writes a timeline PNG: one bar per action at its lockstep start time, as wide as its cost and
    coloured by kind; the rest of each tick is the time the rank waits for the slowest action."""
    try:
        import matplotlib
        import matplotlib.patches
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("render_png needs matplotlib; pip install matplotlib (render_text needs "
                          "nothing)") from e
    if schedule.steady:  # the first steps from an empty pipeline
        schedule = _first_steps(schedule, 3)
    sim = simulate(schedule, costs, mode="lockstep")
    p = schedule.num_ranks
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * sim.total_time), 0.5 * p + 1.2))
    for t, r in np.argwhere(schedule.table[..., 0] != IDLE):
        kind = int(schedule.table[t, r, 0])
        x, w = sim.start[t, r], sim.cost[t, r]
        ax.barh(r, w, left=x, height=0.8, color=_COLORS[kind], edgecolor="black", linewidth=0.5)
        if schedule.pair is not None and schedule.pair[t, r, 0] != IDLE:  # an overlapped pair: two halves
            ax.barh(r, w / 2, left=x + w / 2, height=0.8, color=_COLORS[int(schedule.pair[t, r, 0])],
                    edgecolor="black", linewidth=0.5)
        ax.text(x + w / 2, r, _tick_label(schedule, t, r), ha="center", va="center", fontsize=6,
                color="white")
    kinds = sorted(set(schedule.table[..., 0].ravel().tolist()) - {IDLE})
    ax.legend(handles=[matplotlib.patches.Patch(color=_COLORS[k], label=_LEGEND[k]) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.total_time)
    ax.set_xlabel("time (lockstep)")
    ax.set_title(f"{schedule.name}: p={p} m={schedule.num_microbatches} v={schedule.num_chunks} "
                 f"bubble={sim.bubble:.3f} peak slots={sim.peak_slots}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _first_steps(schedule: Schedule, steps: int) -> Schedule:
    """A steady schedule's first `steps` windows from an empty pipeline, as one table."""
    full = unroll(schedule, steps + 1)  # the last window only finishes the steps before it: not shown
    return dataclasses.replace(full, table=full.table[:steps * schedule.num_ticks])


def render_summary(schedule: Schedule, costs: dict | None = None) -> str:
    """The text timeline, then the async bubble, then one line `schedule=... bubble=... ticks=...` whose
    bubble is the lockstep one (what the SPMD executor pays). A steady schedule (2bw) shows its window
    (microbatches -k: the previous step's, still in flight), then its first steps from an empty pipeline
    with the bubble of each."""
    if schedule.steady:
        steps = 3
        asyn, lock = steady_bubbles(schedule, steps, costs, "async"), steady_bubbles(schedule, steps, costs, "lockstep")
        first_steps = _first_steps(schedule, steps)
        return "\n".join([
            "one step (the window every step runs):", render_text(schedule),
            f"the first {steps} steps from an empty pipeline:", render_text(first_steps),
            "bubble per step, async: " + " ".join(f"{b:.3f}" for b in asyn) +
            "; lockstep: " + " ".join(f"{b:.3f}" for b in lock),
            f"schedule={schedule.name} stages={schedule.num_ranks} microbatches={schedule.num_microbatches} "
            f"bubble={lock[-1]:.3f} (steady, lockstep) peak_slots={schedule.num_slots} ticks={schedule.num_ticks}",
        ])
    lock = simulate(schedule, costs, mode="lockstep")
    asyn = simulate(schedule, costs, mode="async")
    return "\n".join([
        render_text(schedule),
        f"async bubble={asyn.bubble:.3f} time={asyn.total_time:g}; lockstep time={lock.total_time:g}",
        f"schedule={schedule.name} stages={schedule.num_ranks} microbatches={schedule.num_microbatches} "
        f"bubble={lock.bubble:.3f} peak_slots={lock.peak_slots} ticks={schedule.num_ticks}",
    ])
