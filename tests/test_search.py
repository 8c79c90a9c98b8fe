"""parallax/search.py: the candidates are exactly the valid layouts (against a brute-force enumeration), the
analytic price of one candidate by hand, and `plan.py --search` end to end on simulated CPU devices (the
table, the winner compiled and fitting, written as a config that plans as it said)."""
import dataclasses
import itertools
import json
import math

import pytest

from helpers import ROOT, run_launcher
from parallax.estimate import CHIPS
from parallax.search import Candidate, ModelSizes, analytic, candidates

SIZES = ModelSizes(params=1e9, layer_params=2.5e7, flops_per_token=6e9, layers=8, d_model=1024, d_ff=4096,
                   heads=8, kv_heads=2, seq_len=1024, batch=32)


def _by_brute_force(sizes, devices, slices, max_tensor=8):
    expected = set()
    powers = [2**k for k in range(8) if 2**k <= devices]
    for data, fsdp, tensor, pipe in itertools.product(powers, repeat=4):
        if data * fsdp * tensor * pipe != devices or sizes.kv_heads % tensor or sizes.heads % tensor:
            continue
        if sizes.layers % pipe or tensor > min(max_tensor, devices // slices) or sizes.batch % (data * fsdp):
            continue
        rows = sizes.batch // (data * fsdp)
        axes = {"data": data, "fsdp": fsdp, "pipe": pipe}
        for dcn in ([None] if slices == 1 else [a for a, n in axes.items() if n % slices == 0]):
            for remat in ("full", "none"):
                if pipe == 1:
                    expected |= {(data, fsdp, tensor, 1, dcn, None, mb, remat)
                                 for mb in range(1, rows + 1) if rows % mb == 0 and mb & (mb - 1) == 0}
                    continue
                for schedule in ("1f1b", "zbv"):
                    if schedule == "zbv" and sizes.layers % (2 * pipe):
                        continue
                    for r in ([remat, "stage"] if remat == "full" else [remat]):  # + pipeline.remat
                        expected |= {(data, fsdp, tensor, pipe, dcn, schedule, mb, r)
                                     for mb in (pipe, 2 * pipe, 4 * pipe) if rows % mb == 0}
    return expected


def test_candidates_are_every_valid_layout_and_no_other():
    odd = dataclasses.replace(SIZES, layers=5, heads=16, kv_heads=16, batch=48)  # no pipe divides 5
    for sizes, devices, slices in ((SIZES, 16, 1), (SIZES, 16, 2), (odd, 32, 1), (odd, 32, 4)):
        found = {(c.sizes["data"], c.sizes["fsdp"], c.sizes["tensor"], c.sizes["pipe"], c.dcn_axis, c.schedule,
                  c.microbatches, c.remat) for c in candidates(sizes, devices, slices)}
        expected = _by_brute_force(sizes, devices, slices)
        assert found == expected, (devices, slices, found ^ expected)
        assert any(t == 8 for _, _, t, *_ in found) or sizes.kv_heads < 8  # tensor up to max_tensor=8


def test_the_analytic_price_of_one_candidate_by_hand():
    """fsdp=4 x tensor=2 on v5p, 2 microbatches, full remat: 8 devices, 8 rows per batch shard, 4 per
    microbatch (4096 tokens)."""
    chip = CHIPS["v5p"]
    c = Candidate((("data", 1), ("fsdp", 4), ("tensor", 2), ("pipe", 1)), None, None, 2, "full")
    step, gib, sent = analytic(c, SIZES, chip)
    compute = 6e9 * 32 * 1024 / 8 * (4 / 3) / 459e12
    weights = 1e9 / 2  # per tensor rank
    fsdp = (3 * 2 * 2 + 4 * 2) * weights * 3 / 4  # 3 bf16 gathers and 1 fp32 reduce-scatter per microbatch
    tensor = 6 * 2 * (1 / 2) * 4096 * 1024 * 2 * 8 * 2  # 6 all-reduces a layer, 8 layers, 2 microbatches
    assert sent == pytest.approx({"fsdp": fsdp, "tensor": tensor})
    assert step == pytest.approx(max(compute, fsdp / chip.link) + tensor / chip.link)
    state = 16 * weights / 4
    activations = 4096 * 1024 * 2 * 8 + 4096 * (6 * 1024 + 3 * 4096 / 2) * 2 * 2
    assert gib == pytest.approx((state + activations + 2 * 2 * 2.5e7 / 2) / 2**30)
    # over DCN the same bytes take DCN's bandwidth
    over = Candidate(c.mesh, "fsdp", None, 2, "full")
    assert analytic(over, SIZES, chip, slices=2)[0] == pytest.approx(max(compute, fsdp / chip.dcn) + tensor / chip.link)


def test_the_analytic_price_of_a_pipeline_over_dcn_and_of_no_remat_by_hand():
    """data=2 x pipe=2 (pipe over DCN, 2 slices), 1f1b, 4 microbatches, stage remat: 4 devices, 16 rows per
    batch shard, 4 per microbatch; then data=4 x tensor=2 without remat, 2 microbatches."""
    from parallax.pipeline.schedule import make_schedule
    from parallax.pipeline.simulate import simulate

    chip = CHIPS["v5p"]
    c = Candidate((("data", 2), ("fsdp", 1), ("tensor", 1), ("pipe", 2)), "pipe", "1f1b", 4, "stage")
    step, gib, sent = analytic(c, SIZES, chip, slices=2)
    bubble = simulate(make_schedule("1f1b", 2, 4)).bubble
    compute = 6e9 * 32 * 1024 / 4 * (5 / 3) / 459e12 / (1 - bubble)
    data = 2 * 4 * 5e8 / 2  # fp32 gradients of a stage's 5e8 parameters, all-reduced over 2
    pipe = 2 * 2 * 4096 * 1024 * 4  # each microbatch's bf16 activation and its gradient
    assert sent == pytest.approx({"data": data, "pipe": pipe})
    assert step == pytest.approx(max(compute, data / chip.link) + pipe / chip.dcn)
    residual, working = 4096 * 1024 * 2, 4096 * (6 * 1024 + 3 * 4096) * 2 * 2
    # 2 chunk inputs in flight (1f1b, 2 ranks), one stage's 4 layer residuals in its backward
    assert gib == pytest.approx((16 * 5e8 + residual * 2 + residual * 4 + working + 2 * 2 * 2.5e7) / 2**30)
    assert c.apply(__import__("helpers").tiny_config(), 2).pipeline.remat is True

    c = Candidate((("data", 4), ("fsdp", 1), ("tensor", 2), ("pipe", 1)), None, None, 2, "none")
    step, gib, sent = analytic(c, SIZES, chip)
    compute = 6e9 * 32 * 1024 / 8 / 459e12
    data = 2 * 4 * 5e8 * 3 / 4
    tensor = 4 * 2 * (1 / 2) * 4096 * 1024 * 2 * 8 * 2  # 4 all-reduces a layer without recompute
    assert sent == pytest.approx({"data": data, "tensor": tensor})
    assert step == pytest.approx(max(compute, data / chip.link) + tensor / chip.link)
    working = 4096 * (6 * 1024 + 3 * 4096 / 2) * 2 * 2
    assert gib == pytest.approx((16 * 5e8 + (working + 4096 * 1024 * 2 * 4) * 8 + 2 * 2 * 2.5e7 / 2) / 2**30)


def test_the_analytic_price_with_every_axis_and_stage_remat_by_hand():
    """data=2 x fsdp=2 x tensor=2 x pipe=2 on 16 devices, zbv, 4 microbatches, stage remat; fsdp over DCN."""
    from parallax.pipeline.schedule import make_schedule
    from parallax.pipeline.simulate import simulate

    chip = CHIPS["v5p"]
    c = Candidate((("data", 2), ("fsdp", 2), ("tensor", 2), ("pipe", 2)), "fsdp", "zbv", 4, "stage")
    step, gib, sent = analytic(c, SIZES, chip, slices=2)
    compute = 6e9 * 32 * 1024 / 16 * (5 / 3) / 459e12 / (1 - simulate(make_schedule("zbv", 2, 4, 2)).bubble)
    weights = 1e9 / 4  # over tensor x pipe
    tokens = 8 // 4 * 1024  # 8 rows a batch shard, 4 microbatches
    fsdp = (4 * 2 * 4 + 4 * 4) * weights / 2  # 4 bf16 gathers (forward, backward, the stage's and layers' recompute)
    data = 2 * 4 * weights / 2 / 2
    tensor = 8 * 2 * (1 / 2) * tokens * 1024 * 2 * 4 * 4  # 8 all-reduces a layer, 4 layers, 4 microbatches
    pipe = 2 * 2 * tokens * 1024 * 4
    assert sent == pytest.approx({"fsdp": fsdp, "data": data, "tensor": tensor, "pipe": pipe})
    assert step == pytest.approx(max(compute, fsdp / chip.dcn + data / chip.link) + (tensor + pipe) / chip.link)
    residual, working = tokens * 1024 * 2, tokens * (6 * 1024 + 3 * 4096 / 2) * 2 * 2
    assert gib == pytest.approx((16 * weights / 2 + residual * 2 + residual * 4 + working + 2 * 2 * 2.5e7 / 2) / 2**30)


def test_plan_search_compiles_the_likely_winners_and_writes_the_fastest_that_fits(tmp_path):
    out = tmp_path / "best.json"
    run = run_launcher("plan", f"--config={ROOT}/configs/tiny.py", "--devices=8", "--search", "--chip=v5p",
                       "--compile_top=2", "--budget_s=120", f"--search_out={out}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = [line for line in run.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(table) == 2 and all("| yes |" in line for line in table), run.stdout[-3000:]
    best = run.stdout.split("best: ")[1].split(":")[0]
    assert best in table[0]
    saved = json.loads(out.read_text())
    mesh = " ".join(f"{a}={n}" for a, n in saved["mesh"].items() if a in ("data", "fsdp", "tensor", "pipe") and n > 1)
    assert best.startswith(mesh + " "), (best, saved["mesh"])
    assert math.prod(saved["mesh"].values()) == 8
    replan = run_launcher("plan", f"--config={out}")
    assert replan.returncode == 0 and replan.stdout.strip().endswith("fits=yes"), replan.stderr[-2000:]
