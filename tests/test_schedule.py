"""Pipeline schedules: generators validate, bubbles and memory match the papers, the validator rejects
broken tables, the simulator prices ticks honestly, the renderers and the CLI work. No jax needed."""
import dataclasses
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.pipeline.render import render_png, render_summary, render_text
from parallax.pipeline.schedule import (B, BW, F, IDLE, SCHEDULES, W, Schedule, ScheduleError,
                                        circular_colouring, make_schedule, unroll)
from parallax.pipeline.validate import validate
from parallax.pipeline.simulate import (bubble_table, format_bubble_table, live_slots, parse_costs, simulate,
                                        steady_bubbles)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cases():
    for name in SCHEDULES:
        for p in (1, 2, 3, 4, 6):
            for m in (1, 2, 3, 4, 5, 8, 12):
                for v in ((2, 3) if name == "interleaved_1f1b" else (1,)):
                    if (name != "interleaved_1f1b" or m % p == 0) and (name != "dualpipev" or m >= 2 * p):
                        yield name, p, m, v


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_generator_output_validates(name):
    for case_name, p, m, v in _cases():
        if case_name == name:
            s = make_schedule(name, p, m, v)
            validate(s)
            assert s.table.shape == (s.num_ticks, p, 4)
            assert s.num_chunks == (v if name == "interleaved_1f1b" else 2 if name in ("zbv", "v_half", "v_min", "dualpipev")
                                    else 1)


def _async(name, p, m, v=1):
    return simulate(make_schedule(name, p, m, v), mode="async")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_async_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(name):
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            assert _async(name, p, m).bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaved_async_bubble_matches_megatron_formula():
    # Exact (1e-12), not just close: the tables follow Megatron's per-rank program.
    for p in (2, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 4 * p):
                got = _async("interleaved_1f1b", p, m, v).bubble
                assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_zb_h1_bubble_is_about_a_third_of_1f1b_at_1f1b_memory():
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            zb, ref = _async("zb_h1", p, m), _async("1f1b", p, m)
            assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
            assert zb.bubble < 0.42 * ref.bubble
            assert zb.peak_slots == ref.peak_slots == p


def test_v_schedules_hold_a_fraction_of_zbv_activations_with_a_bubble_below_1f1b():
    """V-Half and V-Min (the controllable-memory building blocks, squeezed): at p = 4 and 8 with m = 4p,
    peak live chunk activations at most 3/4 (V-Half) and 1/2 (V-Min) of zbv's (1F1B's memory), and the
    bubble at unit costs below 1F1B's (p-1)/(m+p-1)."""
    for p in (4, 8):
        m = 4 * p
        zbv_peak = _async("zbv", p, m).peak_slots
        for name, share in (("v_half", 0.75), ("v_min", 0.5)):
            v = _async(name, p, m)
            assert v.peak_slots <= share * zbv_peak, (name, p, v.peak_slots, zbv_peak)
            assert v.bubble < (p - 1) / (m + p - 1), (name, p, v.bubble)


def test_zbv_bubble_is_within_four_ticks_of_the_startup_bound():
    # Every rank runs 6m unit actions and rank p-1 cannot start before tick p-1: ticks >= 6m + p - 1.
    # Every m >= p, not only multiples of p: m = p + 1 is where a greedy order that puts F before B falls behind.
    for p in (2, 3, 4, 6, 7, 8):
        for m in range(p, 4 * p + 1):
            s = make_schedule("zbv", p, m)
            assert 6 * m + p - 1 <= s.num_ticks <= 6 * m + p + 3
    assert _async("zbv", 4, 8).bubble < 0.06
    assert _async("zbv", 4, 16).bubble < 0.035


def test_peak_slots_1f1b_is_p_gpipe_is_m():
    assert _async("1f1b", 4, 16).peak_slots == 4
    assert list(_async("1f1b", 4, 16).slots_per_rank) == [4, 3, 2, 1]
    assert _async("gpipe", 4, 16).peak_slots == 16
    assert _async("zbv", 4, 16).peak_slots == 8  # 2p half-size chunk slots: 1F1B's memory
    assert _async("interleaved_1f1b", 4, 16, 2).peak_slots == 11  # Megatron warmup 2(p-1)+(v-1)p, +1


def test_num_slots_equals_peak_live_slots():
    for name, p, m, v in _cases():
        if p in (3, 4) and m in (4, 8):
            s = make_schedule(name, p, m, v)
            assert s.num_slots == simulate(s).peak_slots, name


def test_lockstep_equals_async_for_gpipe_and_split_backward_schedules():
    for name in ("gpipe", "zb_h1", "zbv"):
        s = make_schedule(name, 4, 8)
        assert simulate(s).bubble == pytest.approx(simulate(s, mode="async").bubble, abs=1e-12)
        assert simulate(s).total_time == s.num_ticks or name == "gpipe"


def test_lockstep_fused_1f1b_pays_for_bw_beside_f():
    s = make_schedule("1f1b", 4, 8)
    assert simulate(s).bubble > simulate(s, mode="async").bubble + 0.1


def test_lockstep_tick_lasts_as_long_as_its_slowest_action():
    idle = (IDLE, -1, -1, -1)
    table = np.array([[(F, 0, 0, 0), idle], [(BW, 0, 0, 0), (F, 0, 0, 0)], [idle, idle],
                      [idle, (BW, 0, 0, 0)]], np.int32)
    # Not a valid pipeline (BW on stage 0 before stage 1): the simulator only prices ticks.
    s = Schedule("hand", 2, 1, 1, table, np.array([[0], [1]], np.int32))
    sim = simulate(s, {"F": 1, "B": 2, "W": 1})
    assert sim.total_time == 1 + 3 + 0 + 3
    assert sim.bubble == pytest.approx(1 - 8 / (2 * 7))


def test_async_waits_for_inputs_and_costs_scale():
    s = make_schedule("1f1b", 4, 8)
    sim = simulate(s, parse_costs("F=1,B=2,W=2"), mode="async")
    assert sim.total_time == (8 + 3) * 5
    assert sim.bubble == pytest.approx(3 / 11)


def test_bubble_table_has_a_row_per_schedule_and_m():
    rows = bubble_table(p=2, ms=(2, 4))
    assert [(r[0], r[1]) for r in rows] == [(n, m) for n in SCHEDULES for m in (2, 4)
                                            if n != "dualpipev" or m == 4]  # it needs m >= 2p
    text = format_bubble_table(rows)
    assert text.startswith("| schedule | m |") and "| zbv | 4 |" in text


# ---- validator: hand-broken tables are rejected with a one-line message naming tick and rank.


def _broken(s, edit):
    table = s.table.copy()
    edit(table)
    return dataclasses.replace(s, table=table)


def _find(s, kind, mb, rank):
    return int(np.argwhere((s.table[:, rank, 0] == kind) & (s.table[:, rank, 1] == mb))[0, 0])


def _rejects(s, pattern):
    with pytest.raises(ScheduleError, match=pattern) as e:
        validate(s)
    assert "\n" not in str(e.value)


def test_validator_rejects_swapped_forward_and_backward():
    s = make_schedule("1f1b", 4, 8)
    tf, tb = _find(s, F, 0, 3), _find(s, BW, 0, 3)

    def swap(t):
        t[[tf, tb], 3] = t[[tb, tf], 3]
    _rejects(_broken(s, swap), rf"tick {tf} rank 3: BW\(mb=0, chunk=0\) runs before its own forward .*"
                               rf"move it to tick >= {tf + 2}")


def test_validator_rejects_backward_before_its_input_gradient():
    s = make_schedule("zb_h1", 4, 8)
    t2, t3 = _find(s, B, 1, 2), _find(s, B, 1, 3)

    def early(t):
        t[t3 - 1, 2], t[t2, 2] = t[t2, 2].copy(), t[t3 - 1, 2].copy()  # B(mb=1) on rank 2 moves to t3-1
    _rejects(_broken(s, early), r"rank 2: B\(mb=1, chunk=0\) runs before its input gradient from stage 3")


def test_validator_rejects_dropped_w():
    s = make_schedule("zb_h1", 4, 8)
    tw = _find(s, W, 0, 0)

    def drop(t):
        t[tw, 0] = (IDLE, -1, -1, -1)
    # Dropping W keeps mb 0's slot live, so the F that reuses slot 0 is caught first.
    _rejects(_broken(s, drop), r"rank 0: F\(mb=4, chunk=0\) stores into slot 0, still live for mb=0")
    last = _find(s, W, 7, 1)

    def drop_last(t):
        t[last, 1] = (IDLE, -1, -1, -1)
    _rejects(_broken(s, drop_last), r"mb=7 stage 1 \(rank 1 chunk 0\) has no W; add it")


def test_validator_rejects_duplicated_forward():
    s = make_schedule("gpipe", 2, 4)
    idle_tick = int(np.argwhere(s.table[:, 0, 0] == IDLE)[0, 0])

    def dup(t):
        t[idle_tick, 0] = (F, 2, 0, 3)
    _rejects(_broken(s, dup), rf"tick {idle_tick} rank 0: F\(mb=2, chunk=0\) of stage 0 runs twice")


def test_validator_rejects_reused_live_slot():
    s = make_schedule("1f1b", 4, 8)
    tf = _find(s, F, 1, 0)

    def reuse(t):
        t[tf, 0, 3] = 0  # mb 0 still holds slot 0
        t[(t[:, 0, 1] == 1) & (t[:, 0, 0] == BW), 0, 3] = 0
    _rejects(_broken(s, reuse), rf"tick {tf} rank 0: F\(mb=1, chunk=0\) stores into slot 0, still live")


def test_validator_rejects_slot_mismatch_bad_kind_and_mixed_backward():
    s = make_schedule("zb_h1", 2, 4)
    tb = _find(s, B, 0, 0)
    _rejects(_broken(s, lambda t: t.__setitem__((tb, 0, 3), 7)), r"reads slot 7")
    _rejects(_broken(s, lambda t: t.__setitem__((tb, 0, 0), 9)), r"unknown action kind 9")
    _rejects(_broken(s, lambda t: t.__setitem__((tb, 0, 0), BW)), r"runs both B and BW|already runs BW")
    _rejects(dataclasses.replace(s, table=s.table.astype(np.int64)), r"table must be int32")
    _rejects(dataclasses.replace(s, stage_of=np.array([[0], [0]], np.int32)), r"exactly once")


def test_make_schedule_errors_name_the_fix():
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'; set one of gpipe"):
        make_schedule("pipedream", 4, 8)
    with pytest.raises(ScheduleError, match="multiple of stages=4, got 6; set microbatches=8"):
        make_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="set virtual_stages=2"):
        make_schedule("interleaved_1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="set it to 1"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="microbatches >= 1"):
        make_schedule("zbv", 4, 0)


def test_placement_of_interleaved_and_zbv_chunks():
    s = make_schedule("interleaved_1f1b", 4, 4, 2)
    assert s.stage_of.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]] and s.rank_of_stage(5) == (1, 1)
    z = make_schedule("zbv", 4, 8)
    assert z.stage_of.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]] and z.rank_of_stage(4) == (3, 1)
    assert z.split_backward and not s.split_backward


def test_render_text_marks_kinds_and_chunks():
    text = render_text(make_schedule("1f1b", 2, 2))
    assert text.splitlines() == ["rank 0: F0 F1  . X0  . X1", "rank 1:  . F0 X0 F1 X1  ."]
    assert "F0a" in render_text(make_schedule("zbv", 2, 2)) and "W1b" in render_text(make_schedule("zbv", 2, 2))


def test_render_png_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zbv.png"
    render_png(make_schedule("zbv", 2, 4), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_render_summary_ends_with_the_one_line_result():
    last = render_summary(make_schedule("zb_h1", 4, 8)).splitlines()[-1]
    assert last == "schedule=zb_h1 stages=4 microbatches=8 bubble=0.111 peak_slots=4 ticks=27"


def test_cli_prints_summary_and_exits_2_on_bad_arguments():
    from helpers import run_launcher  # here: the module's other tests need no jax, helpers imports the trainer

    ok = run_launcher("schedule", "--schedule=zbv", "--stages=4", "--microbatches=8", check=True)
    assert ok.stdout.splitlines()[-1] == (
        "schedule=zbv stages=4 microbatches=8 bubble=0.059 peak_slots=8 ticks=51")
    bad = run_launcher("schedule", "--schedule=interleaved_1f1b", "--stages=4", "--microbatches=6", "--virtual=2")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "set microbatches=8" in bad.stderr


@pytest.mark.parametrize("args, message", [
    (("1f1b", 0, 8), "1f1b: need stages >= 1 and microbatches >= 1, got stages=0 microbatches=8"),
    (("gpipe", 4, 0), "gpipe: need stages >= 1 and microbatches >= 1, got stages=4 microbatches=0"),
    (("interleaved_1f1b", 4, 8, 1), "interleaved_1f1b needs virtual_stages >= 2, got 1; set virtual_stages=2"),
    (("interleaved_1f1b", 4, 9, 2),
     "interleaved_1f1b needs microbatches a multiple of stages=4, got 9; set microbatches=12"),
    (("zbv", 4, 8, 3), "zbv always holds 2 chunks per rank, got virtual_stages=3; set it to 2"),
    (("zb_h1", 4, 8, 2), "zb_h1 holds one chunk per rank, got virtual_stages=2; set it to 1 or use "
                         "interleaved_1f1b"),
    (("pipedream", 4, 8), "unknown schedule 'pipedream'; set one of gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, v_half, v_min, "
                             "dualpipev, 2bw"),
    (("dualpipev", 4, 6), "dualpipev needs microbatches >= 2 x stages (8), got 6; set microbatches=8"),
])
def test_make_schedule_error_messages_are_exact(args, message):
    # These reach the user verbatim (the CLI and the trainer print them as the one-line error).
    with pytest.raises(ScheduleError) as e:
        make_schedule(*args)
    assert str(e.value) == message


def test_make_schedule_accepts_the_smallest_and_the_implied_sizes():
    # p = 1 and m = 1 are legal; zbv takes virtual_stages 1 (the default) or 2 and always builds 2 chunks.
    assert make_schedule("1f1b", 1, 1).num_ticks == 2
    assert make_schedule("interleaved_1f1b", 2, 2, 2).num_chunks == 2
    assert make_schedule("zbv", 2, 4, 1).stage_of.tolist() == make_schedule("zbv", 2, 4, 2).stage_of.tolist()


def _rank_program(s, r):
    """Rank r's actions in table order, as (kind, microbatch, local chunk)."""
    return [(int(k), int(mb), int(c)) for k, mb, c, _ in s.table[:, r] if k != IDLE]


def _one_f_one_b_order(fwd, bwd, warmup, bwd_kind=BW):
    """`warmup` forwards, then one forward / one backward while forwards remain, then the cooldown."""
    order = [(F, *a) for a in fwd[:warmup]]
    for i, b in enumerate(bwd):
        if warmup + i < len(fwd):
            order.append((F, *fwd[warmup + i]))
        order.append((bwd_kind, *b))
    return order


@pytest.mark.parametrize("p, m", [(1, 3), (2, 5), (4, 4), (4, 8), (3, 2)])
def test_1f1b_ranks_run_pipedream_flush_order(p, m):
    # Rank r: p-r-1 warmup forwards, then F / BW pairs, then the cooldown backwards (at most p-r live).
    s = make_schedule("1f1b", p, m)
    for r in range(p):
        mbs = [(mb, 0) for mb in range(m)]
        assert _rank_program(s, r) == _one_f_one_b_order(mbs, mbs, min(p - r - 1, m)), r


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 6, 3), (3, 9, 2), (4, 8, 2), (4, 16, 3)])
def test_interleaved_ranks_run_megatrons_program(p, m, v):
    # Megatron's order: microbatches in groups of p, each group through chunk 0..v-1 forward and
    # v-1..0 backward; 2(p-r-1) + (v-1)p warmup forwards on rank r, then F / BW pairs, then the cooldown.
    s = make_schedule("interleaved_1f1b", p, m, v)
    seq = [(g * p + i, c) for g in range(m // p) for c in range(v) for i in range(p)]
    fwd = seq
    bwd = [(mb, v - 1 - c) for mb, c in seq]
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        assert _rank_program(s, r) == _one_f_one_b_order(fwd, bwd, warmup), r


@pytest.mark.parametrize("p, m", [(1, 2), (2, 5), (4, 4), (4, 8), (3, 2)])
def test_zb_h1_ranks_run_b_w_f_rounds_with_w_lagging_by_rank(p, m):
    # Rank r: p-r warmup forwards, then rounds (B_i, W_{i-r}, F_{i+warmup}), then the remaining W's.
    s = make_schedule("zb_h1", p, m)
    for r in range(p):
        warmup = min(p - r, m)
        order = [(F, mb, 0) for mb in range(warmup)]
        for i in range(m):
            order.append((B, i, 0))
            if i - r >= 0:
                order.append((W, i - r, 0))
            if i + warmup < m:
                order.append((F, i + warmup, 0))
        order += [(W, mb, 0) for mb in range(max(m - r, 0), m)]
        assert _rank_program(s, r) == order, r


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_carries_its_name_for_summaries_and_errors(name):
    s = make_schedule(name, 2, 4, 2 if name == "interleaved_1f1b" else 1)
    assert s.name == name
    assert render_summary(s).splitlines()[-1].startswith(f"schedule={name} stages=2 microbatches=4 ")


# ---- simulator: the timing of every action, worked out by hand on 2-rank tables.

NAN = float("nan")


def test_async_starts_each_action_when_its_rank_is_free_and_its_inputs_have_finished():
    # 1f1b(2, 2), F=1 B=2 W=1 so BW=3. Rank 1's F0 waits for rank 0's F0 (t=1); rank 0's BW0 waits for
    # rank 1's BW0 (t=5), its BW1 for rank 1's BW1 (t=9).
    sim = simulate(make_schedule("1f1b", 2, 2), parse_costs("F=1,B=2,W=1"), mode="async")
    np.testing.assert_array_equal(sim.start, [[0, NAN], [1, 1], [NAN, 2], [5, 5], [NAN, 6], [9, NAN]])
    assert (sim.total_time, sim.busy_time, sim.ticks) == (12, 16, 6)
    assert sim.bubble == pytest.approx(1 - 16 / (2 * 12))


def test_async_split_backward_b_waits_for_the_downstream_b():
    # zb_h1(2, 2), F=1 B=2 W=3: rank 0's B0 starts when rank 1's B0 ends (t=4), its B1 when rank 0 is free
    # (t=9, after W0) although rank 1's B1 ended at t=7.
    sim = simulate(make_schedule("zb_h1", 2, 2), {"F": 1, "B": 2, "W": 3}, mode="async")
    np.testing.assert_array_equal(sim.start, [[0, NAN], [1, 1], [NAN, 2], [4, 4], [6, 5], [9, 7], [11, 10]])
    assert sim.total_time == 14 and list(sim.slots_per_rank) == [2, 2]


def test_lockstep_ticks_start_together_and_last_as_long_as_the_slowest():
    sim = simulate(make_schedule("1f1b", 2, 2), {"F": 1, "B": 2, "W": 1})
    np.testing.assert_array_equal(sim.start, [[0, NAN], [1, 1], [NAN, 2], [5, 5], [NAN, 8], [11, NAN]])
    assert (sim.mode, sim.total_time, sim.busy_time) == ("lockstep", 14, 16)


def test_fused_backward_costs_b_plus_w_unless_given():
    s = make_schedule("1f1b", 2, 2)
    bw = s.table[..., 0] == BW
    assert set(simulate(s, {"B": 2, "W": 3}).cost[bw]) == {5.0}
    assert set(simulate(s, {"B": 2, "W": 3, "BW": 4}).cost[bw]) == {4.0}
    assert set(simulate(s).cost[bw]) == {2.0} and set(simulate(s).cost[s.table[..., 0] == F]) == {1.0}
    assert set(simulate(s).cost[s.table[..., 0] == IDLE]) == {0.0}


def test_a_schedule_without_ticks_has_no_bubble():
    s = make_schedule("1f1b", 2, 2)
    empty = dataclasses.replace(s, table=s.table[:0])
    for mode in ("lockstep", "async"):
        sim = simulate(empty, mode=mode)
        assert (sim.total_time, sim.bubble, sim.peak_slots) == (0, 0.0, 0)


def test_parse_costs_reads_every_kind_and_rejects_bad_entries_by_name():
    assert parse_costs("F=1, B=2.5,,W=0.5,BW=3,FB=2") == {"F": 1.0, "B": 2.5, "W": 0.5, "BW": 3.0, "FB": 2.0}
    assert parse_costs("") == {}
    for bad in ("X=2", "F", "F:1", "F=fast", "W=-1"):
        with pytest.raises(ValueError) as e:
            parse_costs(f"B=1,{bad}")
        assert str(e.value) == (f"bad cost {bad!r}; write KIND=VALUE with KIND in F, B, W, BW, FB (an overlapped F "
                                f"and backward pair, dualpipev) and VALUE a number >= 0")
    with pytest.raises(ValueError) as e:
        simulate(make_schedule("1f1b", 2, 2), mode="sync")
    assert str(e.value) == "mode must be 'lockstep' or 'async', got 'sync'"


def test_readme_bubble_table_is_what_bubble_table_prints():
    # The docs' table of bubbles (docs/pipeline.md; p = 4, m = 4, 8, 16) is the default `bubble_table`, printed.
    table = format_bubble_table(bubble_table()).split("\n\n")[0]
    assert table in (REPO / "docs" / "pipeline.md").read_text()


def test_bubble_table_rows_are_the_simulated_figures():
    rows = bubble_table(p=2, ms=(2, 4))
    for name, m, asyn, lock, peak, ticks in rows:
        s = make_schedule(name, 2, m, 2 if name == "interleaved_1f1b" else 1)
        assert asyn == simulate(s, mode="async").bubble and lock == simulate(s).bubble
        assert (peak, ticks) == (simulate(s).peak_slots, s.num_ticks)
    lines = format_bubble_table(rows).splitlines()
    assert lines[:3] == ["| schedule | m | bubble (async) | bubble (lockstep) | peak slots | ticks |",
                         "|---|---|---|---|---|---|", "| gpipe | 2 | 0.333 | 0.333 | 2 | 6 |"]
    assert "| interleaved_1f1b | 2 | 0.200 | 0.250 | 4 | 10 |" in lines
    assert lines[-1].startswith("Costs F = B = W = 1, BW = 2.") and lines[-2] == ""


# --- the steady schedule (2bw) ----------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 3), (3, 5), (4, 4), (4, 8), (6, 12)])
def test_2bw_window_alternates_f_and_bw_with_no_idle_tick_and_repeats_into_a_valid_schedule(p, m):
    """One step's window: 2m ticks, every rank busy on every tick, F and BW alternating; the current step's
    m forwards run on every stage, and the previous step's microbatches (ids -m..-1) only finish. Run back to
    back (`unroll`), the windows are one schedule that `validate` accepts, with each activation held in the
    slot its forward filled (also across windows)."""
    s = make_schedule("2bw", p, m)
    validate(s)
    assert s.steady and s.num_ticks == 2 * m and (s.table[..., 0] != IDLE).all()
    kinds = s.table[..., 0]
    assert ((kinds[1:] == F) != (kinds[:-1] == F)).all() and np.isin(kinds, (F, BW)).all()
    for r in range(p):
        f_mbs = sorted(s.table[kinds[:, r] == F, r, 1].tolist())
        # every microbatch's forward runs once per window on each rank: the current step's, or a late one of
        # the previous step's (ranks 2.. are still starting those when stage 0 starts the next step)
        assert sorted(mb % m for mb in f_mbs) == list(range(m)) and min(f_mbs) >= -m
        assert (min(f_mbs) < 0) == (r >= 2)
    full = unroll(s, 4)
    validate(full)
    assert full.num_microbatches == 3 * m and simulate(full).ticks == 8 * m
    # as many slots as activations live at once, 1F1B's p, when the window's starts are evenly spread
    assert s.num_slots == live_slots(full).max() == p or m % p


def test_2bw_async_bubble_is_zero_after_the_first_step_and_its_lockstep_one_below_1f1bs():
    for p, m in [(2, 4), (4, 8)]:
        s = make_schedule("2bw", p, m)
        first, *rest = steady_bubbles(s, 4, mode="async")
        assert first > 0 and rest == [0.0] * 3
        lock = steady_bubbles(s, 4, mode="lockstep")
        assert lock[1:] == [0.25] * 3  # an F beside a BW (cost 2) on every tick
        assert lock[-1] < simulate(make_schedule("1f1b", p, m), mode="lockstep").bubble


def test_2bw_validator_rejects_a_window_that_does_not_repeat_into_a_valid_schedule():
    s = make_schedule("2bw", 4, 4)
    t = np.argwhere((s.table[:, 2, 0] == F) & (s.table[:, 2, 1] == 0))[0, 0]
    table = s.table.copy()
    table[[t, t - 1], 2] = table[[t - 1, t], 2]  # rank 2's F(0) one tick earlier, beside rank 1's F(0)
    with pytest.raises(ScheduleError, match=r"F\(mb=\d+, chunk=0\) runs before its input activation"):
        validate(dataclasses.replace(s, table=table))
    table = s.table.copy()
    table[0, 1, 1] = -5  # below -m
    with pytest.raises(ScheduleError, match=r"a steady window holds microbatches -4..3, got -5"):
        validate(dataclasses.replace(s, table=table))


def test_2bw_needs_microbatches_at_least_stages_and_has_no_flushing_timing():
    with pytest.raises(ScheduleError, match=r"^2bw needs microbatches >= stages .* set microbatches=4$"):
        make_schedule("2bw", 4, 3)
    with pytest.raises(ScheduleError, match=r"2bw holds one chunk per rank"):
        make_schedule("2bw", 2, 4, 2)
    with pytest.raises(ValueError, match=r"2bw is steady"):
        simulate(make_schedule("2bw", 2, 4))
    with pytest.raises(ScheduleError, match=r"set one of gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, v_half, v_min, dualpipev, 2bw$"):
        make_schedule("pipedream", 2, 4)


def test_circular_colouring_uses_as_few_colours_as_evenly_spaced_intervals_need():
    # 8 intervals of 6 ticks starting every 2 ticks on a circle of 16: at most 3 overlap, but a colour holds
    # at most 2 of them (12 ticks), so 4 colours are needed, and enough (greedy from a cut takes 5)
    busy = [list(range(2 * k, 2 * k + 6)) for k in range(8)]
    colour = circular_colouring(busy, 16)
    assert len(set(colour)) == 4
    for i in range(8):
        for j in range(i):
            if colour[i] == colour[j]:
                assert not {t % 16 for t in busy[i]} & {t % 16 for t in busy[j]}
    with pytest.raises(ScheduleError, match="held for 17 ticks, longer than the window of 16"):
        circular_colouring([list(range(17))], 16)


def _max_overlap(busy, period):
    return max(sum(t in {u % period for u in b} for b in busy) for t in range(period))


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 24).flatmap(lambda period: st.tuples(st.just(period), st.lists(
    st.tuples(st.integers(0, period - 1), st.integers(1, period)), min_size=1, max_size=10))))
def test_circular_colouring_is_proper_and_optimal_where_no_interval_crosses_the_cut(drawn):
    """Random intervals (start, length) on a circle: no two items sharing a tick share a colour, the
    colours are 0..C-1, and C is at least the most items live at one tick; where no interval wraps past
    the end (an interval graph on a line) C equals that maximum, the optimum (by hand: the overlap count)."""
    period, spans = drawn
    busy = [list(range(a, a + n)) for a, n in spans]
    colour = circular_colouring(busy, period)
    for i in range(len(busy)):
        for j in range(i):
            if colour[i] == colour[j]:
                assert not {t % period for t in busy[i]} & {t % period for t in busy[j]}, (i, j, colour)
    assert sorted(set(colour)) == list(range(len(set(colour))))
    assert len(set(colour)) >= _max_overlap(busy, period)
    line = [b for b in busy if b[-1] < period]  # the ones that do not wrap
    if line:
        assert len(set(circular_colouring(line, period))) == _max_overlap(line, period)


def test_circular_colouring_keeps_greedy_where_round_robin_needs_more():
    """Uneven intervals where the round robin in start order clashes at every C below the item count but
    greedy does not: a long interval beside short disjoint ones (2 colours, not 4)."""
    busy = [list(range(0, 8)), [0], [2], [4]]
    colour = circular_colouring(busy, 8)
    assert len(set(colour)) == 2 and colour[1] == colour[2] == colour[3] != colour[0]


def test_render_png_of_2bw_draws_its_first_steps(tmp_path):
    render_png(make_schedule("2bw", 2, 4), str(tmp_path / "2bw.png"))
    assert (tmp_path / "2bw.png").stat().st_size > 1000


def test_render_summary_of_2bw_shows_its_window_the_first_steps_and_their_bubbles():
    text = render_summary(make_schedule("2bw", 2, 4))
    assert text.startswith("one step (the window every step runs):\nrank 0:  F0 X-1  F1  X0")
    assert "the first 3 steps from an empty pipeline:" in text
    assert "bubble per step, async: 0.167 0.000 0.000; lockstep: 0.286 0.250 0.250" in text
    assert text.endswith("schedule=2bw stages=2 microbatches=4 bubble=0.250 (steady, lockstep) peak_slots=2 ticks=8")


def test_best_layout_shortens_the_lockstep_step_at_counted_costs():
    """At Llama 3 8B's proportions (the head and loss about 2.4 layers of forward FLOPs, 32 layers) the
    `auto` layout is never slower than the even one in the simulator, and faster where the head's stage
    sets the pace (zb_h1 at p = 8); the layers all land somewhere."""
    from parallax.pipeline.simulate import best_layout, flop_costs, simulate
    for name, v, p, faster in (("1f1b", 1, 4, False), ("zb_h1", 1, 8, True), ("zbv", 2, 4, False)):
        sched = make_schedule(name, p, 4 * p, v)
        layers = best_layout(sched, 32, 1.0, 0.0, 2.4)
        assert sum(layers) == 32 and len(layers) == p * v
        even, auto = (simulate(s, flop_costs(s, 32, 1.0, 0.0, 2.4)).total_time
                      for s in (sched, sched.with_layers(layers)))
        assert auto <= even and (auto < 0.95 * even) == faster, (name, layers, auto, even)


def test_the_vocabulary_parallel_head_pass_is_priced_on_every_rank():
    """`flop_costs(spread_vocab=True)`: the head's 3 x loss runs as p shares in the last stage's F ticks on
    every rank; the busy time is the same work as without it, and zbv at p = 8 gets faster in lockstep."""
    from parallax.pipeline.simulate import flop_costs, simulate
    sched = make_schedule("zbv", 8, 32, 2)
    plain, spread = (simulate(sched, flop_costs(sched, 32, 1.0, 0.0, 2.4, spread_vocab=v)) for v in (False, True))
    assert abs(plain.busy_time - spread.busy_time) < 1e-6 * plain.busy_time
    assert spread.total_time < 0.75 * plain.total_time, (spread.total_time, plain.total_time)
    with pytest.raises(ValueError, match="lockstep mode only"):
        simulate(sched, flop_costs(sched, 32, 1.0, 0.0, 2.4, spread_vocab=True), mode="async")


def test_dualpipev_bubble_is_the_dualpipe_papers_and_it_holds_one_chunk_more_than_zbv():
    """DeepSeek's table (PP = 2p stages): bubble (PP/2 - 1)(F&B + B - 3W) per rank, F&B the overlapped pair
    and B a full backward; at unit F, B, W without overlap (F&B = F + BW = 3, B = 2, W = 1): 2(p - 1), as
    the async makespan less each rank's work. Activations PP + 1 = 2p + 1 chunk slots (zbv: 2p). A pair
    priced below its parts (FB=2) shortens the step."""
    for p in (2, 3, 4, 8):
        for m in (2 * p, 3 * p + 1):
            s = make_schedule("dualpipev", p, m, 2)
            assert s.paired
            sim = simulate(s, mode="async")
            assert sim.total_time - sim.busy_time / p == pytest.approx((p - 1) * (3 + 2 - 3)), (p, m)
            assert sim.peak_slots == 2 * p + 1 == simulate(make_schedule("zbv", p, m, 2)).peak_slots + 1
            assert simulate(s, {"FB": 2.0}, mode="async").total_time < sim.total_time
