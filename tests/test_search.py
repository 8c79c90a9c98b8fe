"""parallax/search.py: the candidates are exactly the valid layouts (against a brute-force enumeration), the
analytic price of one candidate by hand, and `plan.py --search` end to end on simulated CPU devices (the
table, the winner compiled and fitting, written as a config that plans as it said)."""
import itertools
import json
import math

import pytest

from helpers import ROOT, run_launcher
from parallax.estimate import CHIPS
from parallax.search import Candidate, ModelSizes, analytic, candidates

SIZES = ModelSizes(params=1e9, layer_params=2.5e7, flops_per_token=6e9, layers=8, d_model=1024, d_ff=4096,
                   heads=8, kv_heads=2, seq_len=1024, batch=32)


def test_candidates_are_every_valid_layout_and_no_other():
    for devices, slices in ((16, 1), (16, 2)):
        found = {(c.sizes["data"], c.sizes["fsdp"], c.sizes["tensor"], c.sizes["pipe"], c.dcn_axis, c.schedule,
                  c.microbatches, c.remat) for c in candidates(SIZES, devices, slices)}
        expected = set()
        sizes = [1, 2, 4, 8, 16]
        for data, fsdp, tensor, pipe in itertools.product(sizes, repeat=4):
            if data * fsdp * tensor * pipe != devices or 2 % tensor or SIZES.layers % pipe:  # kv_heads=2
                continue
            if tensor > devices // slices or SIZES.batch % (data * fsdp):
                continue
            rows = SIZES.batch // (data * fsdp)
            axes = {"data": data, "fsdp": fsdp, "pipe": pipe}
            for dcn in ([None] if slices == 1 else [a for a, n in axes.items() if n % slices == 0]):
                for remat in ("full", "none"):
                    if pipe == 1:
                        expected |= {(data, fsdp, tensor, 1, dcn, None, mb, remat)
                                     for mb in range(1, rows + 1) if rows % mb == 0 and mb & (mb - 1) == 0}
                    else:
                        for schedule in ("1f1b", "zbv"):
                            if schedule == "zbv" and SIZES.layers % (2 * pipe):
                                continue
                            for r in ([remat, "stage"] if remat == "full" else [remat]):  # + pipeline.remat
                                expected |= {(data, fsdp, tensor, pipe, dcn, schedule, mb, r)
                                             for mb in (pipe, 2 * pipe, 4 * pipe) if rows % mb == 0}
        assert found == expected, (devices, slices, found ^ expected)


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
