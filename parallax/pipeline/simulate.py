"""Prices a schedule table: total time, bubble fraction and live activation slots, in two timing models.

- `lockstep`: the SPMD executor. All ranks advance tick by tick together, so a tick lasts as long as its
  slowest action (an all-idle tick costs nothing). This is what parallax really pays.
- `async`: the MPMD ideal the papers report. Each rank runs its actions in table order, each starting as
  soon as the rank is free and its inputs have finished (no communication latency).

Where the two differ (default costs F = B = W = 1, BW = 2; figures from `bubble_table`):
- 1f1b and interleaved_1f1b: in the steady state a fused BW (cost 2) shares a tick with an F (cost 1) on
  another rank, so the F's rank idles half that tick. Lockstep bubbles are well above the async ones
  (p=4: 1f1b 0.400 vs 0.273 at m=8, 0.333 vs 0.158 at m=16; interleaved v=2 0.294 vs 0.158 at m=8,
  0.273 vs 0.086 at m=16); this is why split-backward schedules suit the lockstep executor.
- gpipe: forwards and backwards never share a tick, so lockstep equals async.
- zb_h1 and zbv: every action costs 1, so lockstep equals the tick count; async can only be shorter.
"""
import dataclasses

import numpy as np

from parallax.pipeline.schedule import B, BW, F, IDLE, KINDS, W, Schedule, make_schedule, unroll

DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}


@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
    """Timing of one schedule. `start` / `cost`: float [ticks, ranks] per action (NaN / 0 where idle)."""
    mode: str
    total_time: float
    busy_time: float
    bubble: float  # 1 - busy_time / (ranks * total_time)
    slots_per_rank: np.ndarray  # int [ranks]: peak live activation slots
    peak_slots: int  # max over ranks
    ticks: int
    start: np.ndarray
    cost: np.ndarray


def parse_costs(text: str) -> dict:
    """'F=1,B=1,W=1[,BW=2]' -> {'F': 1.0, ...}; raises ValueError naming the bad entry."""
    costs = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        try:
            number = float(value) if sep and key.strip() in ("F", "B", "W", "BW", "FB") else None
        except ValueError:
            number = None
        if number is None or not number >= 0:
            raise ValueError(f"bad cost {item!r}; write KIND=VALUE with KIND in F, B, W, BW, FB (an "
                             f"overlapped F and backward pair, dualpipev) and VALUE a number >= 0")
        costs[key.strip()] = number
    return costs


def _cost_table(schedule: Schedule, costs) -> np.ndarray:
    """float [ticks, ranks]: each action's cost; a kind's cost is one number, or one per global stage. A
    tick that pairs two actions on a rank (`Schedule.pair`) costs `costs['FB']` if given (their overlapped
    time), else the sum of the two."""
    c = dict(DEFAULT_COSTS, **(costs or {}))
    c.pop("head_pass", None)
    pair_cost = c.pop("FB", None)
    c.setdefault("BW", np.add(c["B"], c["W"]))
    stages = schedule.num_stages
    by_kind = np.stack([np.zeros(stages)] + [np.broadcast_to(np.asarray(c[k], float), (stages,))
                                             for k in ("F", "B", "W", "BW")])  # [kind, stage]

    def lane(table):
        kinds, chunks = table[..., 0], np.maximum(table[..., 2], 0)
        return by_kind[kinds, schedule.stage_of[np.arange(schedule.num_ranks)[None, :], chunks]]
    cost = lane(schedule.table)
    if schedule.pair is not None:
        both = schedule.pair[..., 0] != IDLE
        cost = np.where(both, float(pair_cost) if pair_cost is not None else cost + lane(schedule.pair), cost)
    return cost


def flop_costs(schedule: Schedule, num_layers: int, layer: float, embed: float = 0.0, loss: float = 0.0,
               spread_vocab: bool = False) -> dict:
    """Per-stage action costs from counted forward FLOPs (`parallax.pipeline.parts.Parts.flops`), as the
    executor runs the actions: F = the stage's layers (+ the embedding on stage 0; on the last stage the
    head and loss forward *and* backward, which its F runs to start the backward: 3 x `loss`), B = W = the
    layers' forward FLOPs each (input and weight gradients: one matmul each per forward matmul). With
    `spread_vocab` (pipeline.vocab_parallel) the head's 3 x `loss` is split over the ranks and runs on all of them in the tick of
    the last stage's F (`head_pass`: every rank busy for 3 x loss / p in that tick)."""
    n = np.asarray(schedule.stage_layers(num_layers), float)
    f = n * layer
    f[0] += embed
    costs = {"F": f, "B": n * layer, "W": n * layer}
    if spread_vocab:
        costs["head_pass"] = 3 * loss / schedule.num_ranks
    else:
        f[-1] += 3 * loss
    return costs


def best_layout(schedule: Schedule, num_layers: int, layer: float, embed: float = 0.0, loss: float = 0.0,
                spread_vocab: bool = False) -> tuple:
    """Layers per stage for `schedule` that make its lockstep step time (what the executor pays) shortest at
    the per-stage costs of `flop_costs`: from the best of the even layout (when it exists) and the FLOP-
    balanced one (`balanced_layers`), move one layer between two stages while that shortens the step.
    The table does not depend on the layout, so each candidate is one vectorised simulation."""
    from parallax.pipeline.schedule import balanced_layers
    stages = schedule.num_stages

    def time(layers):
        s = schedule.with_layers(layers)
        return simulate(s, flop_costs(s, num_layers, layer, embed, loss, spread_vocab)).total_time
    starts = [balanced_layers(num_layers, stages, layer, embed, 0.0 if spread_vocab else loss)]
    if num_layers % stages == 0:
        starts.append((num_layers // stages,) * stages)
    best = min(starts, key=time)
    best_time = time(best)
    while True:
        moves = [tuple(n - (k == i) + (k == j) for k, n in enumerate(best))
                 for i in range(stages) for j in range(stages) if i != j and best[i] > 0]
        timed = min(((time(m), m) for m in moves), default=(best_time, best))
        if timed[0] >= best_time * (1 - 1e-9):
            return tuple(int(n) for n in best)
        best_time, best = timed


def live_slots(schedule: Schedule) -> np.ndarray:
    """int [ranks]: peak number of activations held at once on each rank (F until its W or BW; in a tick
    that pairs an F with a backward, both are held)."""
    kinds = schedule.table[..., 0]
    gain, lose = (kinds == F).astype(int), np.isin(kinds, (W, BW)).astype(int)  # [ticks, ranks]
    if schedule.pair is not None:
        gain, lose = gain + (schedule.pair[..., 0] == F), lose + np.isin(schedule.pair[..., 0], (W, BW))
    held = np.cumsum(gain - lose, axis=0) + lose  # during tick t: before its W / BW free their slots
    return np.maximum(held.max(axis=0, initial=0), 0)


def simulate(schedule: Schedule, costs: dict | None = None, mode: str = "lockstep") -> SimResult:
    """Times `schedule` with per-kind `costs` (default F = B = W = 1, BW = B + W) in `mode`; a kind's cost
    may be an array over the global stages (`flop_costs`)."""
    if mode not in ("lockstep", "async"):
        raise ValueError(f"mode must be 'lockstep' or 'async', got {mode!r}")
    if schedule.steady:
        raise ValueError(f"{schedule.name} is steady (one window of an endless pipeline): time it with "
                         f"steady_bubbles, or simulate unroll(schedule, steps)")
    table, stage_of = schedule.table, schedule.stage_of
    cost = _cost_table(schedule, costs)
    ticks, p = cost.shape
    start = np.full((ticks, p), np.nan)
    head_pass = float((costs or {}).get("head_pass", 0.0))
    if head_pass and mode != "lockstep":
        raise ValueError("costs['head_pass'] (a pass every rank runs in one tick) is priced in lockstep mode only")
    if mode == "lockstep":
        last = (table[..., 0] == F) & (stage_of[np.arange(p)[None, :], np.maximum(table[..., 2], 0)]
                                       == schedule.num_stages - 1)
        tick_time = cost.max(axis=1, initial=0.0) + head_pass * last.any(axis=1)
        tick_start = np.concatenate([[0.0], np.cumsum(tick_time)])
        busy = table[..., 0] != IDLE
        start[busy] = np.broadcast_to(tick_start[:-1, None], (ticks, p))[busy]
        total = float(tick_start[-1])
    else:
        finish = {}  # (kind, mb, stage) -> finish time
        free = np.zeros(p)
        lanes = [table] + ([schedule.pair] if schedule.pair is not None else [])
        for t in range(ticks):  # every input of an action ran at an earlier tick, so is timed by now
            for r in range(p):
                actions = [tuple(int(x) for x in lane[t, r, :3]) for lane in lanes if lane[t, r, 0] != IDLE]
                if not actions:
                    continue
                inputs = []
                for kind, mb, c in actions:
                    s = int(stage_of[r, c])
                    if kind == F:
                        inputs += [(F, mb, s - 1)] if s > 0 else []
                    elif kind == W:
                        inputs += [(B, mb, s)]
                    else:
                        inputs += [(F, mb, s), (B, mb, s + 1), (BW, mb, s + 1)]
                start[t, r] = max([free[r]] + [finish[k] for k in inputs if k in finish])
                free[r] = start[t, r] + cost[t, r]  # a pair of actions starts and ends together
                for kind, mb, c in actions:
                    finish[kind, mb, int(stage_of[r, c])] = free[r]
        total = float(free.max(initial=0.0))
    busy_time = float(cost.sum()) + (head_pass * p * float(last.any(axis=1).sum()) if head_pass else 0.0)
    slots = live_slots(schedule)
    return SimResult(mode, total, busy_time, 1.0 - busy_time / (p * total) if total else 0.0, slots,
                     int(slots.max(initial=0)), ticks, start, cost)


def steady_bubbles(schedule: Schedule, steps: int = 4, costs: dict | None = None, mode: str = "async") -> list:
    """Bubble of each of the first `steps` training steps of a steady schedule started on an empty
    pipeline: `unroll`ed, each step is one window of ticks; a step's bubble is 1 - its actions' busy time /
    (ranks x the time from the previous step's end to its own). Only the first step has one at unit costs in
    `async` mode: its previous-step microbatches do not exist (2bw: the pipeline fills)."""
    full = unroll(schedule, steps + 1)
    sim = simulate(full, costs, mode)
    n, p = schedule.num_ticks, schedule.num_ranks
    finish = np.where(np.isnan(sim.start), 0.0, sim.start + sim.cost)
    ends = [float(finish[: (k + 1) * n].max(initial=0.0)) for k in range(steps)]
    if mode == "lockstep":  # a step ends with its last tick, also where ranks idle
        tick_time = sim.cost.max(axis=1, initial=0.0)
        ends = [float(tick_time[: (k + 1) * n].sum()) for k in range(steps)]
    out = []
    for k in range(steps):
        busy = float(sim.cost[k * n:(k + 1) * n].sum())
        span = ends[k] - (ends[k - 1] if k else 0.0)
        out.append(1.0 - busy / (p * span) if span else 0.0)
    return out


def bubble_table(p: int = 4, ms=(4, 8, 16)) -> list[tuple]:
    """Rows (schedule, m, async bubble, lockstep bubble, peak slots, ticks) for every schedule at unit
    costs; a schedule of v chunks per rank (interleaved_1f1b) uses v=2."""
    rows = []
    for name, kind in KINDS.items():
        if kind.steady:
            continue
        for m in ms:
            if m < kind.min_microbatches(p):
                continue
            s = make_schedule(name, p, m, kind.virtual_stages(2))
            lock, asyn = simulate(s, mode="lockstep"), simulate(s, mode="async")
            rows.append((name, m, asyn.bubble, lock.bubble, lock.peak_slots, s.num_ticks))
    return rows


def format_bubble_table(rows) -> str:
    """Markdown table of `bubble_table` rows."""
    lines = ["| schedule | m | bubble (async) | bubble (lockstep) | peak slots | ticks |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {m} | {a:.3f} | {l:.3f} | {k} | {t} |" for n, m, a, l, k, t in rows]
    lines.append("\nCosts F = B = W = 1, BW = 2. A slot holds one chunk's activations: 1/v of a rank's "
                 "layers for interleaved_1f1b (v=2) and zbv.")
    return "\n".join(lines)
