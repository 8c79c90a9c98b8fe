"""The schedule validator: every rule a table must keep for the executor to run it.

`validate` checks the table's structure, each cell, and every dependency in tick order: F before B before W
of the same microbatch and stage, data from the previous stage arrived at an earlier tick, one action per
rank per tick, slots not reused while live. A steady schedule is checked as four windows run back to back.
"""
import numpy as np

from parallax.pipeline.schedule import B, BW, F, IDLE, KIND_NAMES, W, Schedule, ScheduleError, action_str, unroll

def _check_structure(s: Schedule):
    table, stage_of = s.table, s.stage_of
    p, v = s.num_ranks, s.num_chunks
    if s.num_ranks < 1 or s.num_microbatches < 1 or s.num_chunks < 1:
        raise ScheduleError(f"need num_ranks, num_microbatches, num_chunks >= 1, got {p}, "
                            f"{s.num_microbatches}, {v}")
    if not isinstance(table, np.ndarray) or table.dtype != np.int32 or table.ndim != 3 or \
       table.shape[1:] != (p, 4):
        raise ScheduleError(f"table must be int32 [ticks, {p}, 4], got "
                            f"{getattr(table, 'dtype', type(table))} {getattr(table, 'shape', '')}")
    if not isinstance(stage_of, np.ndarray) or stage_of.dtype != np.int32 or stage_of.shape != (p, v):
        raise ScheduleError(f"stage_of must be int32 [{p}, {v}], got "
                            f"{getattr(stage_of, 'dtype', type(stage_of))} {getattr(stage_of, 'shape', '')}")
    if not np.array_equal(np.sort(stage_of.ravel()), np.arange(p * v)):
        raise ScheduleError(f"stage_of must hold each stage 0..{p * v - 1} exactly once, got "
                            f"{stage_of.tolist()}")


def _check_cell(s: Schedule, t, r, cell):
    kind, mb, c, slot = (int(x) for x in cell)
    where = f"tick {t} rank {r}"
    if kind == IDLE:
        if (mb, c, slot) != (-1, -1, -1):
            raise ScheduleError(f"{where}: idle cell must be (0, -1, -1, -1), got {tuple(cell.tolist())}")
        return
    if not IDLE < kind <= BW:
        raise ScheduleError(f"{where}: unknown action kind {kind}; use IDLE, F, B, W or BW (0..4)")
    if not 0 <= mb < s.num_microbatches:
        raise ScheduleError(f"{where}: microbatch {mb} out of range 0..{s.num_microbatches - 1}")
    if not 0 <= c < s.num_chunks:
        raise ScheduleError(f"{where}: chunk {c} out of range 0..{s.num_chunks - 1}; chunks are local "
                            f"to the rank that owns the stage")
    if slot < 0:
        raise ScheduleError(f"{where}: {action_str(kind, mb, c)} has slot {slot}; slots are >= 0")


def validate(schedule: Schedule) -> None:
    """Checks `schedule` and raises ScheduleError on the first violation, in tick order."""
    s = schedule
    if s.pair is not None:  # two actions in one tick: each order must hold, i.e. they share no data
        _check_structure(s)
        if s.steady:
            raise ScheduleError(f"{s.name}: a steady schedule cannot pair actions in a tick")
        lone = (s.pair[..., 0] != IDLE) & (s.table[..., 0] == IDLE)
        if lone.any():
            t, r = (int(x) for x in np.argwhere(lone)[0])
            raise ScheduleError(f"tick {t} rank {r}: a paired action beside an idle cell; move it into the table")
        for t, r in np.argwhere(s.pair[..., 0] != IDLE):
            _check_cell(s, int(t), int(r), s.pair[t, r])
        validate(s.serialized())
        return validate(s.serialized(pair_first=True))
    if s.steady:  # run back to back, the windows must be one valid schedule
        _check_structure(s)
        if s.table.size and (s.table[..., 1].min() < -s.num_microbatches):
            raise ScheduleError(f"{s.name}: a steady window holds microbatches -{s.num_microbatches}.."
                                f"{s.num_microbatches - 1}, got {int(s.table[..., 1].min())}")
        return validate(unroll(s, 4))
    _check_structure(s)
    table, stage_of = s.table, s.stage_of
    last = s.num_stages - 1
    at = {}  # (kind, mb, stage) -> first tick
    for t, r in np.argwhere(table[..., 0] != IDLE):
        kind, mb, c, _ = table[t, r]
        if IDLE < kind <= BW and 0 <= mb < s.num_microbatches and 0 <= c < s.num_chunks:
            at.setdefault((int(kind), int(mb), int(stage_of[r, c])), int(t))

    def need(what, input_name, key, t):  # raises unless action `key` ran strictly before tick t
        before = at.get(key)
        if before is None:
            raise ScheduleError(f"{what} needs {input_name} ({KIND_NAMES[key[0]]}(mb={key[1]}) of stage "
                                f"{key[2]}), which never runs; add it before tick {t}")
        if before >= t:
            raise ScheduleError(f"{what} runs before {input_name} ({KIND_NAMES[key[0]]} at tick {before}); "
                                f"move it to tick >= {before + 1}")

    seen = set()
    live = [dict() for _ in range(s.num_ranks)]  # per rank: slot -> (mb, stage) until its W or BW
    f_slot = {}
    for t in range(s.num_ticks):
        for r in range(s.num_ranks):
            cell = table[t, r]
            _check_cell(s, t, r, cell)
            kind, mb, c, slot = (int(x) for x in cell)
            if kind == IDLE:
                continue
            stage = int(stage_of[r, c])
            what = f"tick {t} rank {r}: {action_str(kind, mb, c)}"
            if (kind, mb, stage) in seen:
                raise ScheduleError(f"{what} of stage {stage} runs twice (first at tick "
                                    f"{at[kind, mb, stage]}); remove one")
            seen.add((kind, mb, stage))
            if kind == F:
                if stage > 0:
                    need(what, f"its input activation from stage {stage - 1}", (F, mb, stage - 1), t)
                if slot in live[r]:
                    omb, ostage = live[r][slot]
                    raise ScheduleError(f"{what} stores into slot {slot}, still live for mb={omb} of stage "
                                        f"{ostage}; use a free slot")
                live[r][slot] = (mb, stage)
                f_slot[mb, stage] = slot
                continue
            if kind == W and (BW, mb, stage) in at:
                raise ScheduleError(f"{what}: stage {stage} already runs BW for this microbatch; drop the W "
                                    f"or split the BW into B")
            if kind in (B, BW):
                if (BW if kind == B else B, mb, stage) in at:
                    raise ScheduleError(f"{what}: stage {stage} runs both B and BW for this microbatch; use B + "
                                        f"W or one BW")
                need(what, f"its own forward on stage {stage}", (F, mb, stage), t)
                if stage < last:
                    need(what, f"its input gradient from stage {stage + 1}",
                         (BW if (BW, mb, stage + 1) in at else B, mb, stage + 1), t)
            else:
                need(what, f"its B on stage {stage}", (B, mb, stage), t)
            if f_slot.get((mb, stage)) != slot or live[r].get(slot) != (mb, stage):
                raise ScheduleError(f"{what} reads slot {slot}, but its activation is in slot "
                                    f"{f_slot.get((mb, stage))} (or already freed); use the F's slot")
            if kind in (W, BW):
                del live[r][slot]
    for mb in range(s.num_microbatches):
        for stage in range(s.num_stages):
            r, c = s.rank_of_stage(stage)
            has = {k for k in (F, B, W, BW) if (k, mb, stage) in at}
            if F not in has:
                missing = "F"
            elif not has & {B, W, BW}:
                missing = "backward (BW, or B + W)"
            elif BW not in has:
                missing = next((KIND_NAMES[k] for k in (B, W) if k not in has), None)
            else:
                missing = None
            if missing:
                raise ScheduleError(f"mb={mb} stage {stage} (rank {r} chunk {c}) has no {missing}; add it")
