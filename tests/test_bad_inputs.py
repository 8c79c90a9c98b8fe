"""Every launcher's bad inputs (README: "a bad input is one line on stderr and exit status 2, before anything in
the workdir changes"): a table of command lines, each run to its exit; its stderr must be exactly one line
naming what was typed, its exit status 2, and the paths it names (workdir, output) unchanged -- the same names,
sizes and mtimes, and a path that did not exist still absent.

Cheap by construction: one driver process (tests/bad_inputs_driver.py) imports jax, parallax and lm-eval once
and forks a child per command line, so the table costs one interpreter start, not one per row (and lm-eval's
task index covers only the tasks the rows name: see the driver)."""

import json
import os
import shutil
import subprocess
import sys

from helpers import ROOT

TINY = "--config=configs/tiny.py"


def _inputs(base):
    """The files the table's command lines name, made once: a prepared shard directory, a copy of it with a
    junk document index, jsonl files with a bad line, a plain file, an empty directory, a run's config.json."""
    from parallax.defaults import load_config_file
    from parallax.prepare import prepare

    corpus = base / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + 1  # words to make it longer"})
             for i in range(40)]
    (corpus / "a.jsonl").write_text("\n".join(lines) + "\n")
    shards = str(base / "shards")
    prepare([f"{corpus}/*.jsonl"], shards, progress=False, log=lambda *_: None)
    garbage = base / "garbage"
    shutil.copytree(shards, garbage)
    (garbage / "main-00000.docs.npy").write_bytes(b"junk, not an index" * 24)
    (base / "no_text.jsonl").write_text("\n".join(lines[:5] + ['{"body": "no text"}'] + lines[5:]) + "\n")
    (base / "not_json.jsonl").write_text("\n".join(lines[:2] + ["{not json"]) + "\n")
    turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (base / "no_reply.jsonl").write_text(f"{json.dumps(turn)}\n{json.dumps({'messages': turn['messages'][:1]})}\n")
    (base / "broken.jinja").write_text("{% for m in messages %}{{ m.content }\n{% endfor %}")
    (base / "afile").write_text("a file, not a directory\n")
    (base / "empty").mkdir()
    (base / "other").mkdir()
    (base / "other" / "notes.txt").write_text("not a preparation's directory\n")
    run = base / "run"
    run.mkdir()
    (run / "config.json").write_text(load_config_file(os.path.join(ROOT, "configs", "tiny.py")).to_json())
    (base / "nometrics").mkdir()
    return {"corpus": f"{corpus}/*.jsonl", "shards": shards, "garbage": str(garbage), "afile": str(base / "afile"),
            "empty": str(base / "empty"), "other": str(base / "other"), "run": str(run),
            "no_text": str(base / "no_text.jsonl"), "not_json": str(base / "not_json.jsonl"),
            "no_reply": str(base / "no_reply.jsonl"), "broken_template": str(base / "broken.jinja"),
            "nometrics": str(base / "nometrics"), "new": str(base / "new"), "new2": str(base / "new" / "deeper")}


# (id, launcher, args, watched paths, what the one line must contain); {name} is a path of `_inputs`.
CASES = [
    # train.py (and what every config launcher shares: launch/common.py)
    ("train-workdir-is-a-file", "train", [TINY, "--workdir={afile}", "--cpu_devices=8"], ["afile"],
     "--workdir={afile}: a file, not a directory"),
    ("train-misspelled-flag", "train", ["--confg=configs/tiny.py", "--workdir={new}"], ["new"],
     "--confg: unknown flag; did you mean --config?"),
    ("train-unknown-key", "train", [TINY, "--workdir={new}", "--config.train.stpes=5"], ["new"], "train.stpes"),
    ("train-wrong-type", "train", [TINY, "--workdir={new}", "--config.train.steps=abc"], ["new"], "train.steps"),
    ("train-no-config", "train", ["--workdir={new}"], ["new"], "--config is required"),
    ("train-no-workdir", "train", [TINY], [], "--workdir is required"),
    ("train-config-file-missing", "train", ["--config=/no/such/config.py", "--workdir={new}"], ["new"],
     "/no/such/config.py"),
    ("train-cpu-devices-not-int", "train", [TINY, "--workdir={new}", "--cpu_devices=eight"], ["new"],
     "--cpu_devices"),
    ("train-print-config-kind", "train", [TINY, "--print_config=yaml"], [], "--print_config"),
    ("train-stray-argument", "train", [TINY, "--workdir={new}", "stray"], ["new"], "unexpected arguments ['stray']"),
    ("train-pipe-3-of-8", "train", [TINY, "--workdir={new}", "--cpu_devices=8", "--config.mesh.pipe=3"], ["new"],
     "config.mesh.pipe=3: does not divide the 8 devices"),
    ("train-unknown-mesh-axis", "train", [TINY, "--workdir={new}", "--config.mesh.pipeline=2"], ["new"],
     "mesh.pipeline"),
    ("train-data-path-typo", "train", [TINY, "--workdir={new}", "--cpu_devices=8", "--config.data.source=tokens",
                                       "--config.data.path={shards}x", "--config.model.vocab_size=0"], ["new"],
     "config.data.path='{shards}x': no such directory"),
    ("train-token-file-typo", "train", [TINY, "--workdir={new}", "--cpu_devices=8", "--config.data.source=tokens",
                                        "--config.data.path=/no/such.uint16.bin", "--config.data.eos_id=0"], ["new"],
     "config.data.path='/no/such.uint16.bin': no such token file"),
    ("train-garbage-shard-index", "train", [TINY, "--workdir={new}", "--cpu_devices=8", "--config.data.source=tokens",
                                            "--config.data.path={garbage}", "--config.model.vocab_size=0"],
     ["new", "garbage"], "main-00000.docs.npy' is damaged (no .npy header)"),
    ("train-steps-negative", "train", [TINY, "--workdir={new}", "--config.train.steps=-1"], ["new"],
     "train.steps=-1"),
    ("train-batch-0", "train", [TINY, "--workdir={new}", "--config.train.global_batch_size=0"], ["new"],
     "global_batch_size=0"),
    ("train-lr-negative", "train", [TINY, "--workdir={new}", "--config.optim.lr=-0.1"], ["new"], "lr=-0.1"),
    ("train-unknown-source", "train", [TINY, "--workdir={new}", "--config.data.source=csv"], ["new"], "csv"),
    # sample.py
    ("sample-misspelled-flag", "sample", ["--workdir={run}", "--promt=hi"], ["run"],
     "--promt: unknown flag; did you mean --prompt?"),
    ("sample-no-run", "sample", ["--workdir={new}"], ["new"], "--workdir={new}: no config.json there"),
    ("sample-no-checkpoint", "sample", ["--workdir={run}"], ["run"], "--workdir={run}: no checkpoint yet"),
    ("sample-bad-mesh", "sample", ["--workdir={run}", "--mesh=fsdp=two"], ["run"], "--mesh=fsdp=two"),
    ("sample-tokens-not-int", "sample", ["--workdir={run}", "--tokens=many"], ["run"], "--tokens"),
    ("sample-temperature-negative", "sample", ["--workdir={run}", "--temperature=-1"], ["run"], "--temperature=-1"),
    ("sample-tokens-negative", "sample", ["--workdir={run}", "--tokens=-5"], ["run"], "--tokens=-5"),
    ("sample-top-p-2", "sample", ["--workdir={run}", "--top_p=2"], ["run"], "--top_p=2"),
    ("sample-config-override", "sample", ["--workdir={run}", "--config.train.steps=3"], ["run"],
     "--config.* overrides are not used by this command"),
    # plan.py
    ("plan-no-config", "plan", [], [], "--config is required"),
    ("plan-devices-not-int", "plan", [TINY, "--devices=many"], [], "--devices"),
    ("plan-unknown-key", "plan", [TINY, "--config.model.layerz=2"], [], "model.layerz"),
    ("plan-misspelled-flag", "plan", [TINY, "--device=8"], [], "--device: unknown flag; did you mean --devices?"),
    # prepare_data.py
    ("prepare-no-output", "prepare_data", ["--inputs={corpus}"], [], "--output is required"),
    ("prepare-misspelled-flag", "prepare_data", ["--inputs={corpus}", "--outptu={new}"], ["new"],
     "--outptu: unknown flag; did you mean --output?"),
    ("prepare-no-files", "prepare_data", ["--inputs=/no/such/*.jsonl", "--output={new}"], ["new"], "matches no files"),
    ("prepare-line-without-text", "prepare_data", ["--inputs={no_text}", "--output={new}", "--noprogress"], ["new"],
     "{no_text}:6: no 'text' field"),
    ("prepare-line-not-json", "prepare_data", ["--inputs={not_json}", "--output={new}", "--noprogress"], ["new"],
     "{not_json}:3: not JSON"),
    ("prepare-chat-without-reply", "prepare_data", ["--inputs={no_reply}", "--output={new}", "--chat_template=chatml",
                                                    "--noprogress"], ["new"],
     "{no_reply}:2: a conversation with no assistant turn (roles: user); add the assistant's reply, or pass "
     "--loss_on=all"),
    ("prepare-chat-template-does-not-parse", "prepare_data", ["--inputs={no_reply}", "--output={new}",
                                                              "--chat_template={broken_template}"], ["new"],
     "--chat_template='{broken_template}': {broken_template} does not parse (line 1: unexpected '}}')"),
    ("prepare-dir-without-tokenizer", "prepare_data", ["--inputs={corpus}", "--output={new}", "--tokenizer={empty}"],
     ["new", "empty"], "--tokenizer='{empty}': the directory holds no tokenizer.json"),
    ("prepare-workers-0", "prepare_data", ["--inputs={corpus}", "--output={new}", "--workers=0"], ["new"],
     "--workers=0"),
    ("prepare-shard-mb-0", "prepare_data", ["--inputs={corpus}", "--output={new}", "--shard_mb=0"], ["new"],
     "--shard_mb=0"),
    ("prepare-output-not-a-preparation", "prepare_data", ["--inputs={corpus}", "--output={other}", "--noprogress"],
     ["other"], "--output={other}: not empty and not a preparation's directory"),
    ("prepare-rerun-over-garbage-index", "prepare_data", ["--inputs={corpus}", "--output={garbage}", "--noprogress"],
     ["garbage"], "main-00000.docs.npy' is damaged (no .npy header); delete the shard's files"),
    # train_tokenizer.py
    ("tokenizer-no-output", "train_tokenizer", ["--inputs={corpus}"], [], "--output is required"),
    ("tokenizer-no-files", "train_tokenizer", ["--inputs=/no/such/*.txt", "--output={new}"], ["new"],
     "matches no files"),
    ("tokenizer-vocab-too-small", "train_tokenizer", ["--inputs={corpus}", "--output={new}", "--vocab_size=100"],
     ["new"], "--vocab_size=100"),
    ("tokenizer-misspelled-flag", "train_tokenizer", ["--input={corpus}", "--output={new}"], ["new"],
     "--input: unknown flag; did you mean --inputs?"),
    # hf_export.py
    ("export-out-is-a-file", "hf_export", ["--workdir={run}", "--out={afile}"], ["run", "afile"],
     "--out={afile}: a file, not a directory"),
    ("export-no-out", "hf_export", ["--workdir={run}"], ["run"], "--out is required"),
    ("export-dtype", "hf_export", ["--workdir={run}", "--out={new}", "--dtype=float16"], ["run", "new"],
     "--dtype=float16"),
    ("export-no-checkpoint", "hf_export", ["--workdir={run}", "--out={new}"], ["run", "new"],
     "--workdir={run}: no checkpoint yet"),
    ("export-no-run", "hf_export", ["--workdir={empty}", "--out={new}"], ["empty", "new"],
     "--workdir={empty}: no config.json there"),
    # hf_import.py
    ("import-no-hf-dir", "hf_import", ["--workdir={new}"], ["new"], "--hf_dir is required"),
    ("import-hf-dir-missing", "hf_import", ["--hf_dir=/no/such/model", "--workdir={new}"], ["new"], "/no/such/model"),
    ("import-hf-dir-without-config", "hf_import", ["--hf_dir={empty}", "--workdir={new}"], ["new", "empty"],
     "--hf_dir={empty}: cannot read config.json"),
    # harness.py (lm-eval's command line)
    ("harness-unknown-task", "harness", ["--model", "parallax", "--model_args", "workdir={run}", "--tasks",
                                         "no_such_task"], ["run"], "--tasks no_such_task: no task named no_such_task"),
    ("harness-task-offline", "harness", ["--model", "parallax", "--model_args", "workdir={run}", "--tasks",
                                         "lambada_openai"], ["run"],
     "--tasks lambada_openai: its data is not cached and cannot be downloaded"),
    ("harness-no-run", "harness", ["--model", "parallax", "--model_args", "workdir={new}", "--tasks",
                                   "lambada_openai"], ["new"], "--model_args workdir={new}: no config.json there"),
    ("harness-misspelled-flag", "harness", ["--model", "parallax", "--taks", "lambada_openai"], [],
     "unrecognized arguments: --taks lambada_openai"),
    # schedule.py
    ("schedule-unknown", "schedule", ["--schedule=2f2b"], [], "2f2b"),
    ("schedule-stages-0", "schedule", ["--stages=0"], [], "stages"),
    ("schedule-bad-costs", "schedule", ["--costs=F=fast"], [], "--costs=F=fast: bad cost 'F=fast'"),
    ("schedule-png-dir-missing", "schedule", ["--png={new2}/t.png"], ["new"], "--png={new2}/t.png: its directory"),
    ("schedule-png-flag-typo", "schedule", ["--pgn=out.png"], [], "--pgn: unknown flag; did you mean --png?"),
    # plot.py
    ("plot-no-workdir", "plot", [], [], "--workdir is required"),
    ("plot-no-metrics", "plot", ["--workdir={nometrics}"], ["nometrics"], "metrics.jsonl"),
    ("plot-out-dir-missing", "plot", ["--workdir={nometrics}", "--out={new2}/m.png"], ["nometrics", "new"],
     "its directory does not exist"),
    # bench.py
    ("bench-unknown-part", "bench", ["--part=everything"], [], "--part"),
    ("bench-steps-0", "bench", ["--steps=0"], [], "--steps=0"),
    ("bench-unknown-schedule", "bench", ["--part=pipeline", "--schedules=1f1b,2f2b"], [], "unknown schedule"),
    # delay_study.py
    ("delay-study-no-config", "delay_study", ["--workdir={new}"], ["new"], "--config is required"),
]


def _run_table(base):
    """{case id: the driver's result} for every row of CASES, and the paths the rows name."""
    paths = _inputs(base)
    cases = [{"id": name, "script": script, "args": [a.format(**paths) for a in args],
              "watch": [paths[w] for w in watch]} for name, script, args, watch, _ in CASES]
    with open(base / "cases.json", "w") as f:
        json.dump(cases, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # offline: what a task needing a download meets
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bad_inputs_driver.py"),
                           str(base / "cases.json"), str(base / "results.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(base / "results.json") as f:
        return json.load(f), paths


def test_the_table_covers_every_launcher():
    launchers = {n[:-3] for n in os.listdir(os.path.join(ROOT, "launch")) if n.endswith(".py")} - {"__init__", "common"}
    assert launchers == {script for _, script, *_ in CASES}
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_every_bad_input_is_one_line_and_exit_2_and_changes_nothing(tmp_path):
    # One test, not one per row: under pytest-xdist the rows of a parametrized test could land on both workers,
    # each paying for the driver. Every failing row is reported.
    got, paths = _run_table(tmp_path)
    failures = []
    for name, _, _, _, expected in CASES:
        r = got[name]
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        if r["rc"] != 2 or len(lines) != 1:
            failures.append(f"{name}: exit {r['rc']}, {len(lines)} lines on stderr:\n{r['stderr'][-2000:]}")
        elif expected.format(**paths) not in lines[0]:
            failures.append(f"{name}: {lines[0]!r} does not say {expected.format(**paths)!r}")
        if r["after"] != r["before"]:
            failures.append(f"{name}: changed what it names: {r['before']} -> {r['after']}")
    assert not failures, f"{len(failures)} of {len(CASES)} rows:\n" + "\n".join(failures)
