"""Pictures of a run for people: training curves from `metrics.jsonl` and how an array lies on the mesh.

`plot_runs(workdirs, path)` draws train loss, eval loss (and per mixture source), the learning rate, the
gradient norm and throughput (tokens/s per device, and MFU when the metrics have it) of one or more runs into
a PNG (`launch/plot.py` is its command line); `curves` is what it draws, as data.
`plot_sharding(array)` draws which devices hold which block of a sharded array (the notebooks use it).
Both need matplotlib (the `dev` extra).
"""

from __future__ import annotations

import json
import os

import numpy as np


class MetricsError(ValueError):
    """A workdir has no usable metrics.jsonl; the message names it and the fix."""


def read_metrics(workdir: str) -> list[dict]:
    """The records of `workdir/metrics.jsonl` (a torn last line, from a killed run, is skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise MetricsError(f"{workdir}: no metrics.jsonl there; train into it first, e.g. python "
                           f"launch/train.py --config=configs/quickstart.py --workdir={workdir}")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    # A step that completed no batch (a 2bw run's first) has no loss; its other keys (eval_loss) still count.
    records = [r for r in records if isinstance(r, dict) and "step" in r]
    if not records:
        raise MetricsError(f"{workdir}: metrics.jsonl has no logged steps yet; train longer than "
                           f"train.log_every steps, or pick the workdir of a run that has")
    return records


def _pyplot():
    import matplotlib.pyplot as plt  # the backend is the caller's (a notebook's inline one; launch/plot.py: Agg)
    return plt


def curves(runs, labels) -> dict:
    """What `plot_runs` draws: {panel title: {line label: (steps, values)}} for the runs' records (lists of
    metrics.jsonl rows) named by `labels`. Panels, each where any run logged it: train loss; eval loss, one
    line per run and one per mixture source (`eval_loss/SOURCE`); the learning rate; the gradient norm;
    tokens/s per device (steps that include compilation left out); MFU in percent (the same steps); goodput in
    percent and the wall time in each of its buckets (`parallax.goodput`), summed over the workdir's attempts."""
    def series(records, key, skip_compile=False):
        rows = [r for r in records if key in r and not (skip_compile and r.get("includes_compile"))]
        return [r["step"] for r in rows], [r[key] for r in rows]

    def speed_key(records):
        return "tokens_per_sec_per_device" if any("tokens_per_sec_per_device" in r for r in records) else \
            "tokens_per_sec"
    logged = {k for records in runs for r in records for k in r}
    sources = sorted(k for k in logged if k.startswith("eval_loss/"))
    panels = {"train loss": lambda records: {"": series(records, "loss")}}
    if "eval_loss" in logged or sources:
        panels["eval loss"] = lambda records: {k[len("eval_loss"):]: series(records, k)
                                               for k in ["eval_loss"] + sources}
    if "lr" in logged:
        panels["learning rate"] = lambda records: {"": series(records, "lr")}
    if "grad_norm" in logged:
        panels["gradient norm"] = lambda records: {"": series(records, "grad_norm")}
    panels["tokens/s per device"] = lambda records: {"": series(records, speed_key(records), skip_compile=True)}
    if "mfu" in logged:
        panels["MFU (%)"] = lambda records: {"": (lambda st, v: (st, [100 * x for x in v]))(
            *series(records, "mfu", skip_compile=True))}
    if "goodput" in logged:  # parallax.goodput: over every attempt of the workdir so far
        panels["goodput (%)"] = lambda records: {"": (lambda st, v: (st, [100 * x for x in v]))(
            *series(records, "goodput"))}
        buckets = [k for k in sorted(logged) if k.startswith("goodput/") and k.endswith("_s")]
        panels["wall time by bucket (s)"] = lambda records: {
            " " + k[len("goodput/"):-2]: series(records, k) for k in buckets}
    out = {}
    for title, get in panels.items():
        out[title] = {}
        for records, label in zip(runs, labels):
            for suffix, (steps, values) in get(records).items():
                if steps:
                    out[title][label + suffix] = (steps, values)
    return out


def plot_runs(workdirs, path: str, labels=None) -> str:
    """Draws the curves of the runs in `workdirs` (`curves`: one colour per line) into the PNG `path`, in
    rows of three panels; returns `path`. Raises MetricsError for a workdir without logged steps."""
    runs = [read_metrics(w) for w in workdirs]
    labels = labels or [os.path.basename(os.path.normpath(w)) or w for w in workdirs]
    panels = curves(runs, labels)
    plt = _pyplot()
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for label, (steps, values) in lines.items():
            ax.plot(steps, values, "o-" if len(steps) < 20 else "-", markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if title == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _blocks(array, dims):
    """{(slice per shown dim): [device ids]} of a jax.Array's addressable and remote shards."""
    blocks = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        key = tuple((index[d].start or 0, array.shape[d] if index[d].stop is None else index[d].stop) for d in dims)
        blocks.setdefault(key, []).append(device.id)
    return blocks


def plot_sharding(array, names=None, dims=None, ax=None, title=None):
    """Draws how `array` (a sharded jax.Array) lies on its mesh: one rectangle per block of two of its dims,
    labelled with the ids of the devices holding it (several ids: replicas). `names`: logical axis names per
    dim (axis labels); `dims`: the two dims to show (default: the sharded ones, else the last two); other
    dims are shown whole. Returns the matplotlib Axes."""
    shape = array.shape
    if dims is None:
        spec = tuple(getattr(array.sharding, "spec", ())) + (None,) * len(shape)
        sharded = [d for d in range(len(shape)) if spec[d] is not None]
        dims = (sharded + [d for d in reversed(range(len(shape))) if d not in sharded])[:2]
        dims = sorted(dims) if len(shape) > 1 else [0]
    dims = list(dims)
    if ax is None:
        plt = _pyplot()
        _, ax = plt.subplots(figsize=(5, 4))
    blocks = _blocks(array, dims)
    rows = shape[dims[0]]
    cols = shape[dims[1]] if len(dims) > 1 else 1
    groups = sorted({tuple(sorted(ids)) for ids in blocks.values()})
    colors = _pyplot().get_cmap("tab20")(np.linspace(0, 1, max(len(groups), 2)))
    for key, ids in blocks.items():
        (r0, r1), (c0, c1) = key[0], key[1] if len(key) > 1 else (0, 1)
        color = colors[groups.index(tuple(sorted(ids)))]
        ax.add_patch(_pyplot().Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="black"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, "dev " + ",".join(map(str, sorted(ids))), ha="center", va="center",
                fontsize=7)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    label = lambda d: f"dim {d} ({names[d]}, {shape[d]})" if names and names[d] else f"dim {d} ({shape[d]})"
    ax.set_ylabel(label(dims[0]))
    if len(dims) > 1:
        ax.set_xlabel(label(dims[1]))
    spec = getattr(array.sharding, "spec", None)
    ax.set_title(title or f"shape {tuple(shape)}, spec {tuple(spec) if spec is not None else array.sharding}",
                 fontsize=9)
    return ax
