"""Runs many launcher command lines cheaply for tests/test_bad_inputs.py: this one process imports what the
launchers import (jax, parallax, absl, lm-eval) once, then per command line forks a child that sets sys.argv,
imports `launch.<script>` (its flags are defined at import, so each child defines them afresh) and calls its
`cli()`. The parent reads the child's stderr through a pipe and its exit status, and lists the watched paths
(names, sizes, mtimes) before and after.

    python tests/bad_inputs_driver.py CASES.json RESULTS.json

CASES.json: [{"id", "script", "args": [...], "watch": [paths]}]; RESULTS.json: {id: {"rc", "stderr",
"before", "after"}}. jax's backend is never started here (a fork after it has threads is unsafe): each child
starts its own. lm-eval's task index is cut to what the harness rows name (`_small_task_index`)."""

import importlib
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listing(path):
    """{relative path: (size, mtime_ns)} of everything under `path` (a file: itself); None if it does not exist."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        st = os.lstat(path)
        return {".": [st.st_size, st.st_mtime_ns]}
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            out[os.path.relpath(full, path)] = [st.st_size if name in filenames else 0, st.st_mtime_ns]
    st = os.lstat(path)
    out["."] = [0, st.st_mtime_ns]
    return out


def _child(script, args, err_w):
    os.dup2(err_w, 2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    code = 1
    try:
        sys.argv = [os.path.join(ROOT, "launch", f"{script}.py"), *args]
        importlib.import_module(f"launch.{script}").cli()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- reported as the traceback it is, exit 1
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_case(case):
    watch = case.get("watch", [])
    before = {p: listing(p) for p in watch}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(case["script"], case["args"], w)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    after = {p: listing(p) for p in watch}
    return {"rc": os.waitstatus_to_exitcode(status), "stderr": b"".join(chunks).decode(errors="replace"),
            "before": before, "after": after}


def _small_task_index():
    """lm-eval's task index over its `lambada` directory only, in place of every task yaml it ships (16 s to
    parse on 2 cores, for two rows): the harness rows name lambada_openai and a task that exists nowhere, so
    they meet the same lm-eval errors (an unknown name, data not cached) that the full index gives."""
    from pathlib import Path

    import lm_eval.tasks
    from lm_eval.tasks import _index

    build, shipped = _index.TaskIndex.build, Path(lm_eval.tasks.__file__).parent

    def build_small(paths, **kwargs):
        return build([shipped / "lambada" if Path(p) == shipped else p for p in paths], **kwargs)

    _index.TaskIndex.build = staticmethod(build_small)


def main(cases_path, results_path):
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    # What the launchers import, once (not launch.* itself: those define absl flags at import).
    import absl.app  # noqa: F401
    import jax  # noqa: F401
    import lm_eval.__main__  # noqa: F401
    import parallax.harness  # noqa: F401
    import parallax.hf  # noqa: F401
    import parallax.prepare  # noqa: F401
    import parallax.sample  # noqa: F401
    import parallax.train  # noqa: F401
    import launch.common  # noqa: F401
    _small_task_index()
    with open(cases_path) as f:
        cases = json.load(f)
    results = {case["id"]: run_case(case) for case in cases}
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
