"""Corpus preparation (`parallax/prepare.py`) against expectations written by hand: how inputs are cut into
units (by the files' own sizes, line ends and row groups, read with pyarrow / datasets), what each unit reads
as, the plan and manifest it writes, its restarts, its workers, its progress and log lines, and its refusals
word for word. All with the byte tokenizer on inputs of a few hundred bytes: about 10 s in all."""

import builtins
import concurrent.futures
import hashlib
import json
import os
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax import chat as chat_lib
from parallax import corpus as shard_lib
from parallax import prepare as prep
from parallax import tokenizer as tok_lib
from parallax.errors import ConfigError

QUIET = dict(progress=False, log=lambda *_: None)
BYTES = tok_lib.ByteTokenizer(256)  # what prepare's default tokenizer is


def _refused(call, *args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        call(*args, **kw)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _no_pyarrow(monkeypatch):
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("pyarrow") else real_import(name, *a, **k))


def _pyarrow_message(path):
    return f"{path}: reading parquet / datasets files needs pyarrow; pip install pyarrow (or parallax[data])"


def test_files_group_by_size_and_the_plan_lists_every_input_file(tmp_path):
    """Whole files are grouped in sorted order until a group reaches shard_bytes (empty files skipped, the
    rest a last group); the plan's file list holds every file with its size and mtime."""
    sizes = {"a": 3, "b": 0, "c": 5, "d": 2, "e": 7, "f": 1}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    units, files = prep.plan_units([("src", str(tmp_path))], 8)
    path = lambda n: str(tmp_path / n)  # noqa: E731
    assert [(u.kind, u.paths, u.size) for u in units] == [
        ("files", (path("a"), path("c")), 8),  # 3 + 5 reaches 8
        ("files", (path("d"), path("e")), 9),
        ("files", (path("f"),), 1)]  # what is left
    assert files == [(path(n), s, os.stat(path(n)).st_mtime_ns) for n, s in sizes.items()]
    (tmp_path / "mixed").mkdir()  # jsonl files and a text file in one source: a file's units each, then the group
    for name in ("x1.jsonl", "x2.jsonl"):
        _write_lines(tmp_path / "mixed" / name, [{"text": "a"}, {"text": "b"}])
    (tmp_path / "mixed" / "t.txt").write_text("text")
    units, _ = prep.plan_units([("m", str(tmp_path / "mixed"))], 1 << 20)
    mixed = lambda n: str(tmp_path / "mixed" / n)  # noqa: E731
    assert [(u.kind, u.paths, u.start, u.stop) for u in units] == [
        ("jsonl", (mixed("x1.jsonl"),), 0, 28), ("jsonl", (mixed("x2.jsonl"),), 0, 28),
        ("files", (mixed("t.txt"),), 0, 0)]
    message = _refused(prep.plan_units, [("web", str(tmp_path / "nothing*"))], 8)
    assert message == (f"--inputs web={tmp_path}/nothing*: matches no files; fix the pattern (globs need quotes, ** "
                       "for subdirectories)")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert _refused(prep.plan_units, [("e", str(tmp_path / "empty.jsonl"))], 8) == (
        f"--inputs e={tmp_path}/empty.jsonl: every file it matches is empty; point it at a corpus")
    # files that are not text: a NUL byte is a binary file, skipped; bytes that are not UTF-8 are replaced
    (tmp_path / "bin").write_bytes(b"ab\0cd")
    (tmp_path / "latin").write_bytes("café".encode("latin-1"))
    (tmp_path / "gone").write_bytes(b"")
    unit = prep.Unit("src", "files", (str(tmp_path / "bin"), str(tmp_path / "latin"), str(tmp_path / "gone")))
    assert prep.read_unit(unit) == ["caf\ufffd"]


def _line_ends(data: bytes) -> list[int]:
    ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
    return ends + ([len(data)] if data and not data.endswith(b"\n") else [])


def _ranges_by_hand(ends, size, shard_bytes):
    """From each start, a unit runs to the first line end past start + shard_bytes, else to the file's end."""
    out, start = [], 0
    while start < size:
        past = [e for e in ends if e > start + shard_bytes]
        out.append((start, past[0] if past else size))
        start = out[-1][1]
    return out


_LINE = st.tuples(st.text(alphabet="ab é日\r\n\"\\", max_size=12),
                  st.sampled_from(['{"text": %s}\n', '{"text":\r%s}\n', '{"id": 1, "text": %s}\r\n', '%s']))


@settings(max_examples=40, deadline=None)
@given(lines=st.lists(_LINE, max_size=12), shard_bytes=st.integers(1, 120), last_newline=st.booleans())
def test_a_jsonl_file_is_cut_at_line_ends_and_its_units_read_back_every_line(tmp_path_factory, lines, shard_bytes,
                                                                             last_newline):
    """Units of a jsonl file (blank lines, CRLF, a bare CR as JSON whitespace, UTF-8 text, no final newline)
    against the cuts written out by hand; read back, they give every non-empty text in order."""
    texts, parts = [], []
    for text, form in lines:
        if form == "%s":
            parts.append(" \r\n" if text else "\n")  # a blank line
        else:
            parts.append(form % json.dumps(text, ensure_ascii=False))
            texts.append(text)
    data = "".join(parts).encode()
    if not last_newline and data.endswith(b"\n"):
        data = data[:-1]
    path = tmp_path_factory.mktemp("jsonl") / "f.jsonl"
    path.write_bytes(data)
    if not data:
        assert "every file it matches is empty" in _refused(prep.plan_units, [("j", str(path))], shard_bytes)
        return
    units, _ = prep.plan_units([("j", str(path))], shard_bytes)
    assert [(u.kind, u.start, u.stop, u.size) for u in units] == [
        ("jsonl", a, b, b - a) for a, b in _ranges_by_hand(_line_ends(data), len(data), shard_bytes)]
    assert [t for u in units for t in prep.read_unit(u)] == [t for t in texts if t]


def test_parquet_and_datasets_units_follow_the_row_groups_and_rows_their_libraries_report(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    rows = [f"row {i} " * (i + 1) for i in range(9)]
    pq.write_table(pa.table({"text": rows, "n": list(range(9))}), tmp_path / "t.parquet", row_group_size=2)
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    group = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]  # 5 groups: 2, 2, 2, 2, 1
    shard_bytes = group[0] + group[1]  # the first unit reaches it exactly with two groups
    units, _ = prep.plan_units([("pq", str(tmp_path / "t.parquet"))], shard_bytes)
    expected, first, acc = [], 0, 0  # by hand: add groups until the sum reaches shard_bytes, and cut after the last
    for g, size in enumerate(group):
        acc += size
        if acc >= shard_bytes or g == len(group) - 1:
            expected.append((first, g + 1, acc))
            first, acc = g + 1, 0
    assert expected[0] == (0, 2, shard_bytes)
    assert [(u.kind, u.start, u.stop, u.size) for u in units] == [("parquet",) + e for e in expected]
    assert [t for u in units for t in prep.read_unit(u)] == rows

    # A datasets directory of two arrow files: one row per unit at the smallest shard_bytes, each unit's size
    # its share of its file's bytes (datasets' own reading of the file); one unit per file when it fits.
    docs = [f"document {i} " * (i % 4 + 1) for i in range(7)]
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    arrow = sorted(str(p) for p in (tmp_path / "ds").glob("*.arrow"))
    tables = [datasets.Dataset.from_file(f).data.table for f in arrow]
    units, files = prep.plan_units([("hf", str(tmp_path / "ds"))], 1)
    assert files == [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in arrow]
    assert [(u.kind, u.paths, u.start, u.stop, u.size) for u in units] == [
        ("arrow", (f,), r, r + 1, int(t.nbytes / t.num_rows)) for f, t in zip(arrow, tables) for r in range(t.num_rows)]
    assert [t for u in units for t in prep.read_unit(u)] == docs
    units, _ = prep.plan_units([("hf", str(tmp_path / "ds"))], 1 << 30)
    assert [(u.paths, u.start, u.stop, u.size) for u in units] == [
        ((f,), 0, t.num_rows, t.nbytes) for f, t in zip(arrow, tables)]
    datasets.Dataset.from_dict({"text": ["only"]}).save_to_disk(str(tmp_path / "one"))
    (unit,), _ = prep.plan_units([("one", str(tmp_path / "one"))], 1 << 30)
    assert unit.size == datasets.Dataset.from_file(unit.paths[0]).data.table.nbytes
    # an arrow file in the IPC file format (not the stream datasets writes), and a dataset without data files
    (tmp_path / "ipc").mkdir()
    with pa.ipc.new_file(str(tmp_path / "ipc" / "data.arrow"), pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": ["x", "", "yz"]}))
    (tmp_path / "ipc" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    units, _ = prep.plan_units([("ipc", str(tmp_path / "ipc"))], 1 << 30)
    assert [t for u in units for t in prep.read_unit(u)] == ["x", "yz"]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "state.json").write_text("{}")
    assert prep._arrow_files(str(tmp_path / "bare")) == []
    assert "every file it matches is empty" in _refused(prep.plan_units, [("b", str(tmp_path / "bare"))], 1)

    # The column refusals name at most 8 of the columns; so do a jsonl line's keys; a line that is not an
    # object names its type.
    pq.write_table(pa.table({f"c{i}": [1] for i in range(10)}), tmp_path / "wide.parquet")
    assert _refused(prep.plan_units, [("w", str(tmp_path / "wide.parquet"))], 1) == (
        f"{tmp_path}/wide.parquet: no 'text' column (it has: c0, c1, c2, c3, c4, c5, c6, c7); pass --text_field=NAME")
    datasets.Dataset.from_dict({"body": ["b"]}).save_to_disk(str(tmp_path / "body"))
    assert _refused(prep.plan_units, [("b", str(tmp_path / "body"))], 1) == (
        f"{tmp_path}/body: no 'text' column (it has: body); pass --text_field=NAME")
    (tmp_path / "wide.jsonl").write_text(json.dumps({f"k{i}": 1 for i in range(10)}) + "\n")
    assert _refused(prep.plan_units, [("w", str(tmp_path / "wide.jsonl"))], 1) == (
        f"{tmp_path}/wide.jsonl:1: no 'text' field (it has: k0, k1, k2, k3, k4, k5, k6, k7); fix the line, or "
        "pass --text_field=NAME")
    (tmp_path / "list.jsonl").write_text('{"text": "a"}\n[1, 2]\n')
    assert _refused(prep.plan_units, [("l", str(tmp_path / "list.jsonl"))], 1) == (
        f"{tmp_path}/list.jsonl:2: no 'text' field (it has: list); fix the line, or pass --text_field=NAME")

    # Without pyarrow, each way in names the file it was reading.
    _no_pyarrow(monkeypatch)
    parquet, data = str(tmp_path / "t.parquet"), arrow[0]
    assert _refused(prep._check_field, parquet, "parquet", "text") == _pyarrow_message(parquet)
    assert _refused(prep._split_file, "pq", parquet, "parquet", 0, 1) == _pyarrow_message(parquet)
    assert _refused(prep.read_unit, prep.Unit("pq", "parquet", (parquet,), 0, 1)) == _pyarrow_message(parquet)
    assert _refused(prep._arrow_table, data) == _pyarrow_message(data)


def _chat(user, reply=None):
    return {"messages": [{"role": "user", "content": user}] + ([{"role": "assistant", "content": reply}]
                                                                if reply is not None else [])}


def _chatml(*turns):
    """ChatML written out by hand: the text a conversation renders to."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def test_chat_rows_are_checked_line_by_line_and_loss_on_all_needs_no_assistant(tmp_path):
    chat_rows = lambda: prep.ChatRows(BYTES, "chatml", "assistant")  # noqa: E731
    good = json.dumps(_chat("hi", "yo"))
    cases = {  # the second line of a file of chat rows -> the one line that refuses it
        "\n" + json.dumps({"text": "x"}): "3: not a chat row (it has: text); every line of a file of conversations "
                                          "holds 'messages', or 'prompt' and 'completion'",
        "[1]": "2: not a chat row (it has: list); every line of a file of conversations holds 'messages', or "
               "'prompt' and 'completion'",
        json.dumps({f"k{i}": 1 for i in range(10)}): "2: not a chat row (it has: k0, k1, k2, k3, k4, k5, k6, k7); "
                                                     "every line of a file of conversations holds 'messages', or "
                                                     "'prompt' and 'completion'",
    }
    for i, (second, message) in enumerate(cases.items()):
        (tmp_path / f"c{i}.jsonl").write_text(good + "\n" + second + "\n")
        assert _refused(prep.plan_units, [("c", str(tmp_path / f"c{i}.jsonl"))], 1, chat=chat_rows()) == (
            f"{tmp_path}/c{i}.jsonl:{message}")
    (tmp_path / "nj.jsonl").write_text(good + "\n{nope\n")
    assert re.fullmatch(rf"{tmp_path}/nj\.jsonl:2: not JSON \(.*\); each line must be one JSON object",
                        _refused(prep.plan_units, [("c", str(tmp_path / "nj.jsonl"))], 1, chat=chat_rows()))
    # a bare CR as JSON whitespace in the first line: still a file of chat rows, read whole
    (tmp_path / "cr.jsonl").write_bytes(b'{"messages":\r' + json.dumps(_chat("a", "b")["messages"]).encode() + b"}\n")
    units, _ = prep.plan_units([("c", str(tmp_path / "cr.jsonl"))], 1, chat=chat_rows())
    assert [u.kind for u in units] == ["chat"] and prep.read_unit(units[0]) == [_chat("a", "b")]

    # loss_on=all: a conversation without an assistant turn is fine, and its document is the whole rendering
    (tmp_path / "user.jsonl").write_text(json.dumps(_chat("only me")) + "\n")
    manifest = prep.prepare([str(tmp_path / "user.jsonl")], str(tmp_path / "all"), chat_template="chatml",
                            loss_on="all", **QUIET)
    shard = shard_lib.Shard(str(tmp_path / "all"), manifest["shards"][0], manifest["dtype"])
    assert bytes(np.asarray(shard.tokens).astype(np.uint8)).decode() == _chatml(("user", "only me"))
    assert manifest["chat"] == {"template": "chatml", "loss_on": "all",
                                "template_sha256": hashlib.sha256(chat_lib.NAMED["chatml"].encode()).hexdigest()}


def _write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_file_changed_since_its_plan_is_refused_naming_the_file(tmp_path, monkeypatch):
    """A unit read after its file changed (the plan holds byte ranges): the refusal names file:line where the
    checks find it, else the file, the unit's byte range and the line, and says to rerun."""
    path = tmp_path / "t.jsonl"
    _write_lines(path, [{"text": "a" * 90}, {"text": "b"}])
    (unit,), _ = prep.plan_units([("t", str(path))], 1 << 20)
    _write_lines(path, [{"text": "a" * 90}, {"body": "b"}])
    assert _refused(prep.read_unit, unit) == (f"{path}:2: no 'text' field (it has: body); fix the line, or pass "
                                              "--text_field=NAME")
    line = b'{"text": "' + b"c" * 120 + b'"}'
    path.write_bytes(line + b"\n")  # whole lines, but the unit ends inside one now
    assert _refused(prep.read_unit, unit) == (
        f"{path}: a line in bytes [0, {unit.stop}) is not a JSON object with a 'text' field (the file changed "
        f"since it was planned; rerun with --overwrite): {line[:80]!r}")

    settings_ = prep.ChatRows(BYTES, "chatml", "assistant").resolve("-")
    chat = tmp_path / "c.jsonl"
    _write_lines(chat, [_chat("hi", "yo"), _chat("how", "so")])
    (unit,), _ = prep.plan_units([("c", str(chat))], 1 << 20, chat=prep.ChatRows(BYTES, "chatml", "assistant"))
    out = str(tmp_path / "out")
    os.makedirs(out)
    BYTES.copy_to(os.path.join(out, "tokenizer"))
    tokenize = lambda: prep.tokenize_unit(unit, "c-00000", os.path.join(out, "tokenizer"), out, "uint16",  # noqa
                                          "text", BYTES.hash, settings_)
    _write_lines(chat, [_chat("hi", "yo"), _chat("how")])
    assert _refused(tokenize) == (f"{chat}:2: a conversation with no assistant turn (roles: user); add the "
                                  "assistant's reply, or pass --loss_on=all to train on every token")
    chat.write_bytes(b"[" + b" " * (unit.stop - 2) + b"\n")
    assert _refused(tokenize) == (f"{chat}: a line in bytes [0, {unit.stop}) is not JSON (the file changed since it "
                                  f"was planned; rerun with --overwrite): {(b'[' + b' ' * 79)!r}")
    # a row the checks pass but tokenization refuses (here: told to by the test)
    _write_lines(chat, [_chat("hi", "yo"), _chat("how", "so")])
    monkeypatch.setattr(chat_lib, "tokenize", lambda *a: (_ for _ in ()).throw(chat_lib.ChatError("no ids")))
    assert _refused(tokenize) == f"{chat}: a row in bytes [0, {unit.stop}): no ids"
    monkeypatch.undo()
    prep._WORKER_TOKENIZER.clear()
    assert _refused(prep._tokenizer, os.path.join(out, "tokenizer"), "0123456789abcdef") == (
        f"{out}/tokenizer: the tokenizer copy has hash {BYTES.hash[:12]}, not the plan's 0123456789ab; rerun with "
        "--overwrite")


def test_the_plan_and_manifest_hold_what_was_prepared_by_hand_and_restarts_redo_damaged_shards(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    renames, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((a, b)) or replace(a, b))
    (tmp_path / "src").mkdir()
    texts = {"a.txt": "a" * 8000, "b.txt": "b" * 6000, "c.txt": "third one here"}
    shard_mb = 13000 / (1 << 20)  # a and b reach it; the jsonl file (12,490 bytes) is one unit
    for name, text in texts.items():
        (tmp_path / "src" / name).write_text(text)
    lines = [f"line {i}" for i in range(600)]  # more documents than one encode batch, in one unit
    _write_lines(tmp_path / "l.jsonl", [{"body": t} for t in lines])
    inputs = ["code=src", f"web={tmp_path}/l.jsonl"]
    os.makedirs("out")  # an empty directory the user made, in a directory that is not empty
    manifest = prep.prepare(inputs, "out", "", shard_mb=shard_mb, text_field="body", **QUIET)
    assert not os.path.exists(prep.PLAN)
    # every file is written as a temporary beside it (one file system: the rename is atomic) whose name a
    # restart deletes (*.tmp)
    assert {b for _, b in renames} >= {os.path.join("out", prep.PLAN), os.path.join("out", shard_lib.MANIFEST)}
    for temporary, final in renames:
        assert os.path.dirname(temporary) == os.path.dirname(final) and temporary.endswith(".tmp"), temporary
    with open(os.path.join("out", prep.PLAN)) as f:
        plan = json.load(f)
    pairs = [["code", "src"], ["web", f"{tmp_path}/l.jsonl"]]
    assert {k: v for k, v in plan.items() if k not in ("files", "units")} == {
        "format": shard_lib.FORMAT, "tokenizer_hash": BYTES.hash, "dtype": "uint16", "text_field": "body",
        "shard_mb": shard_mb, "inputs": pairs}
    assert [f[0] for f in plan["files"]] == [f"src/{n}" for n in texts] + [f"{tmp_path}/l.jsonl"]
    assert [(u["name"], u["paths"]) for u in plan["units"]] == [
        ("code-00000", ["src/a.txt", "src/b.txt"]), ("code-00001", ["src/c.txt"]),
        ("web-00000", [f"{tmp_path}/l.jsonl"])]
    tokens = {"code": sum(len(t) + 1 for t in texts.values()), "web": sum(len(t) + 1 for t in lines)}
    assert manifest["sources"] == {
        "code": {"inputs": ["src"], "documents": 3, "tokens": tokens["code"], "shards": 2},
        "web": {"inputs": [f"{tmp_path}/l.jsonl"], "documents": 600, "tokens": tokens["web"], "shards": 1}}
    assert (manifest["documents"], manifest["tokens"]) == (603, sum(tokens.values()))
    assert manifest["tokenizer"]["kind"] == "bytes" and [e["name"] for e in manifest["shards"]] == [
        "code-00000", "code-00001", "web-00000"]
    web = shard_lib.Shard("out", manifest["shards"][2], "uint16")
    ids = np.asarray(web.tokens)
    np.testing.assert_array_equal(ids, np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 256)
                                                       for t in lines]))
    # the defaults: 64 MB units, the byte tokenizer
    prep.prepare(["src"], "defaults", **QUIET)
    with open(os.path.join("defaults", prep.PLAN)) as f:
        assert json.load(f)["shard_mb"] == 64

    # A committed text shard whose last token is no longer eos is damaged: the rerun refuses it.
    first = os.path.join("out", shard_lib.token_file("code-00000", "uint16"))
    kept = open(first, "rb").read()
    with open(first, "r+b") as f:
        f.seek(-2, 2)
        f.write(np.array([7], "<u2").tobytes())
    os.remove(os.path.join("out", shard_lib.MANIFEST))
    assert _refused(prep.prepare, inputs, "out", "", shard_mb=shard_mb, text_field="body", **QUIET) == (
        "shard 'code-00000' in 'out' is damaged (its index does not fit its tokens); delete its files and rerun to "
        "write it again")
    with open(first, "wb") as f:
        f.write(kept)
    assert _refused(prep.prepare, inputs[:1], "out", **QUIET) == (
        "--output=out: was prepared from other inputs or settings (its prepare.json differs); pass a new --output, "
        "or --overwrite to replace it")

    # A chat preparation whose mask file was lost: the rerun writes that shard again, mask and all.
    _write_lines(tmp_path / "c.jsonl", [_chat("hi", "yo"), _chat("how", "so")])
    manifest = prep.prepare([f"{tmp_path}/c.jsonl"], "chat", chat_template="chatml", **QUIET)
    with open(os.path.join("chat", prep.PLAN)) as f:
        assert json.load(f)["chat"] == manifest["chat"] == {
            "template": "chatml", "loss_on": "assistant",
            "template_sha256": hashlib.sha256(chat_lib.NAMED["chatml"].encode()).hexdigest()}
    mask = os.path.join("chat", shard_lib.mask_file("main-00000"))
    kept = open(mask, "rb").read()
    os.remove(mask)
    os.remove(os.path.join("chat", shard_lib.MANIFEST))
    assert prep.prepare([f"{tmp_path}/c.jsonl"], "chat", chat_template="chatml", **QUIET) == manifest
    assert open(mask, "rb").read() == kept


def test_settings_are_refused_word_for_word(tmp_path):
    (tmp_path / "t.txt").write_text("text")
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n')
    inputs, out = [str(tmp_path / "t.txt")], str(tmp_path / "out")
    assert _refused(prep.prepare, inputs, out, workers=0, **QUIET) == "--workers=0: must be >= 1"
    assert _refused(prep.prepare, inputs, out, shard_mb=0, **QUIET) == "--shard_mb=0: must be > 0"
    tok_lib.ByteTokenizer(None).copy_to(str(tmp_path / "no_eos"))
    assert _refused(prep.prepare, inputs, out, str(tmp_path / "no_eos"), **QUIET) == (
        f"--tokenizer={tmp_path}/no_eos: it has no eos token to end documents with; use a tokenizer with one "
        "(train_tokenizer.py writes <|endoftext|>), or bytes")
    assert _refused(prep.prepare, [str(tmp_path / "t.jsonl")], out, chat_template="chatml", **QUIET) == (
        "--chat_template=chatml: no input holds chat rows (jsonl lines with 'messages', or 'prompt' and "
        "'completion'); drop the flag or point --inputs at conversations")
    assert not os.path.exists(out)
    # iter_texts reads the field it is given (the lines have no 'text')
    (tmp_path / "b.jsonl").write_text('{"body": "x"}\n{"body": "yy"}\n')
    assert list(prep.iter_texts([str(tmp_path / "b.jsonl")], "body")) == ["x", "yy"]


def test_log_lines_and_the_progress_bar_count_what_was_written(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("abc" * 1000 * (i + 1))
    size = 3000 * 6
    logs = []
    start = time.perf_counter()
    manifest = prep.prepare([str(tmp_path / "f*.txt")], str(tmp_path / "out"), shard_mb=0.002, log=logs.append)
    wall = time.perf_counter() - start
    assert logs[0] == (f"prepare: 3 files, 3 shards (3 to write), 0.0 MB of input, 1 worker; {BYTES.describe()}")
    tokens = manifest["tokens"]
    assert tokens == size + 3
    done = re.fullmatch(rf"prepare: wrote {tmp_path}/out: 3 documents, {tokens:,} tokens in 3 shards "
                        r"\(([\d,]+) tok/s over (\d+\.\d) s\)", logs[1])
    assert done, logs[1]
    assert float(done.group(2)) <= wall + 0.05 and int(done.group(1).replace(",", "")) >= tokens / wall - 1
    bar = capsys.readouterr().err.split("\r")[-1].strip()
    from tqdm import tqdm

    total = tqdm.format_sizeof(size, divisor=1000)
    shown = re.fullmatch(rf"prepare: 100%\|█+\| {re.escape(total)}/{re.escape(total)} \[[\d:<]+, [\d.]+[kM]?B/s, "
                         rf"{tokens:,} tokens, ([\d,]+) tok/s\]", bar)
    assert shown, bar
    assert int(shown.group(1).replace(",", "")) >= tokens / wall - 1
    logs.clear()
    prep.prepare([str(tmp_path / "f*.txt")], str(tmp_path / "two"), shard_mb=0.2, workers=2, progress=False,
                 log=logs.append)
    assert logs[0] == f"prepare: 3 files, 1 shards (1 to write), 0.0 MB of input, 2 workers; {BYTES.describe()}"
    assert capsys.readouterr().err == ""


def test_one_worker_works_in_this_process_and_more_are_spawned_fresh(tmp_path, monkeypatch):
    """workers=1 (the default) tokenizes here; a pool's processes are spawned, not forked: they import
    parallax anew (here: a tok_lib.load broken in this process does not reach them), chat units included.
    A worker turns the tokenizers library's own threads off."""
    (tmp_path / "t.txt").write_text("plain text")
    _write_lines(tmp_path / "c.jsonl", [_chat("hi", "yo")])
    inputs = [str(tmp_path / "t.txt"), f"chat={tmp_path}/c.jsonl"]
    calls = []
    real = prep.tokenize_unit
    monkeypatch.setattr(prep, "tokenize_unit", lambda *a: calls.append(a[1]) or real(*a))
    one = prep.prepare(inputs, str(tmp_path / "one"), chat_template="chatml", **QUIET)
    assert calls == ["main-00000", "chat-00000"]
    monkeypatch.undo()  # (a pool pickles the function it runs by name)
    monkeypatch.setattr(tok_lib, "load", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("not in a worker")))
    monkeypatch.setattr(prep, "_WORKER_TOKENIZER", {})  # nothing cached here for a forked worker to inherit
    pools = []

    class Pool(concurrent.futures.ProcessPoolExecutor):  # the pool prepare starts, as it is started
        def __init__(self, max_workers=None, mp_context=None, initializer=None, **kwargs):
            pools.append((max_workers, mp_context and mp_context.get_start_method(), initializer))
            super().__init__(max_workers, mp_context=mp_context, initializer=initializer, **kwargs)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    two = prep.prepare(inputs, str(tmp_path / "two"), chat_template="chatml", workers=2, **QUIET)
    assert calls == ["main-00000", "chat-00000"] and two["shards"] == one["shards"]
    assert pools == [(2, "spawn", prep._worker_init)]
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    prep._worker_init()
    # the values the tokenizers library reads as off (its utils/parallelism.rs, lowercased)
    assert os.environ["TOKENIZERS_PARALLELISM"].lower() in ("", "off", "false", "f", "no", "n", "0")
