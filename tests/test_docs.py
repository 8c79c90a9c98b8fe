"""The docs' figures that come from the code are what the code prints now: the pipeline page's simulated
tables and timelines, the README's bubbles, the tick counts beside the benchmark's times, the tables of
defaults and flags, the count of bad inputs and the quickstart model's size. A failure says where the
page's new figures come from. Nothing is compiled: a few seconds."""
import pathlib
import re

import pytest

from parallax.pipeline import tables
from parallax.pipeline.render import render_summary
from parallax.pipeline.schedule import KINDS, make_schedule
from parallax.pipeline.simulate import simulate

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PIPELINE = (DOCS / "pipeline.md").read_text()


def _block(page: str, marker: str) -> list:
    """The lines of the fenced block of `page` that holds `marker`."""
    blocks = page.split("```")[1::2]
    [block] = [b for b in blocks if marker in b]
    return block.strip("\n").splitlines()


def _table(page: str, header: str) -> list:
    """The rows (lists of stripped cells) of the markdown table of `page` whose first line starts with
    `header`, its header and separator left out."""
    lines = page[page.index(header):].splitlines()
    end = next((k for k, line in enumerate(lines) if not line.startswith("|")), len(lines))
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:end]]


@pytest.mark.parametrize("table", ["choice_table", "messages_table", "dualpipev_table"])
def test_pipeline_pages_simulated_tables_are_what_the_tables_module_prints(table):
    assert getattr(tables, table)() in PIPELINE, (
        f"docs/pipeline.md: the {table} is out of date; paste what `python -m parallax.pipeline.tables` prints")


def test_pipeline_pages_timelines_are_what_launch_schedule_prints():
    """The zb_h1 timeline whole; the 2bw window, its first steps left out (`launch/schedule.py` prints them)."""
    zb_h1 = render_summary(make_schedule("zb_h1", 4, 8)).splitlines()
    assert _block(PIPELINE, "schedule=zb_h1 stages=4") == zb_h1, (
        "docs/pipeline.md: python launch/schedule.py --schedule=zb_h1 --stages=4 --microbatches=8")
    window = render_summary(make_schedule("2bw", 4, 8)).splitlines()
    shown = _block(PIPELINE, "one step (the window every step runs):")
    assert shown == window[:5] + [next(line for line in window if line.startswith("bubble per step"))], (
        "docs/pipeline.md: python launch/schedule.py --schedule=2bw --stages=4 --microbatches=8")


def test_readme_bubbles_at_4_stages_and_8_microbatches_are_the_simulated_ones():
    readme = " ".join((DOCS.parent / "README.md").read_text().split())  # prose: line breaks are spaces
    m = re.search(r"At 4 stages and 8 microbatches the bubble .*? is ([\d.]+) for zb_h1 and ([\d.]+) for zbv, "
                  r"against ([\d.]+) for 1f1b", readme)
    assert m, "README.md no longer states the bubbles at 4 stages and 8 microbatches"
    simulated = [f"{simulate(make_schedule(n, 4, 8, KINDS[n].virtual_stages(2))).bubble:.3f}"
                 for n in ("zb_h1", "zbv", "1f1b")]
    assert list(m.groups()) == simulated


def test_benchmark_tables_tick_counts_are_the_schedules():
    """docs/benchmarks.md's pipeline table: p = 4, m = 8, as `launch/bench.py --part=pipeline` builds them."""
    rows = _table((DOCS / "benchmarks.md").read_text(), "| schedule | ticks |")
    assert rows
    for name, ticks, *_ in rows:
        assert int(ticks) == make_schedule(name, 4, 8, KINDS[name].virtual_stages(2)).num_ticks, name


def test_moe_pages_defaults_are_the_configs():
    from parallax.defaults import default_config

    defaults = default_config(model="moe").model.moe
    rows = _table((DOCS / "moe.md").read_text(), "| key | default | meaning |")
    assert {k for row in rows for k in re.findall(r"`(\w+)`", row[0])} == set(defaults)
    for keys, values, _ in rows:
        for key, text in zip(re.findall(r"`(\w+)`", keys), values.split(", "), strict=True):
            value = defaults[key]
            if isinstance(value, bool):
                assert text == str(value).lower(), key
            elif isinstance(value, (int, float)):
                assert float(text) == value, key
            else:
                assert text == value, key


def test_parallelism_pages_platform_flags_are_the_ones_set():
    from parallax.mesh import PLATFORM_FLAGS

    rows = {row[0]: row[1:] for row in _table((DOCS / "parallelism.md").read_text(), "| platform | variable |")}
    for platform, label in (("tpu", "TPU (all)"), ("gpu", "GPU")):
        variable, flags = PLATFORM_FLAGS[platform]
        assert rows[label] == [f"`{variable}`", f"`{' '.join(flags)}`"], platform


def test_testing_pages_count_of_bad_inputs_is_the_tables():
    from test_bad_inputs import CASES

    m = re.search(r"a table of (\d+) bad command lines", " ".join((DOCS / "testing.md").read_text().split()))
    assert m and int(m.group(1)) == len(CASES), "docs/testing.md: the rows of tests/test_bad_inputs.py's CASES"


def test_the_quickstart_models_parameter_counts_are_the_plans():
    """The quickstart model's size where the pages state it (what `launch/train.py` prints in its first line),
    and data.md's same model over a BPE of 4,096 ids."""
    from parallax.defaults import load_config_file
    from parallax.plan import make_plan

    config = load_config_file(str(DOCS.parent / "configs" / "quickstart.py"))
    size = f"{make_plan(config, 1).num_params / 1e6:.2f}M"
    for page in ("README.md", "docs/getting-started.md", "docs/configs.md", "docs/diloco.md"):
        text = (DOCS.parent / page).read_text()
        assert f"{size}-parameter" in text or f"{size} parameters" in text, (page, size)
    config.model.vocab_size = 4096
    size = f"{make_plan(config, 1).num_params / 1e6:.2f}M"
    assert f"{size}-parameter" in (DOCS / "data.md").read_text(), size
