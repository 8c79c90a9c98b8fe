"""Corpus preparation: text files -> a shard directory (`parallax.corpus`), what `launch/prepare_data.py` runs.

**Inputs** are `NAME=PATTERN` pairs (NAME names the source for `data.mixture`; `main` when omitted). A pattern
is a glob (`**` recursive), a file or a directory. By kind:

* `.jsonl` / `.ndjson` (one JSON object per line): the document is the `text_field` of each line; a file
  whose first line has no `text_field` but `messages` (or `prompt` and `completion`) is a file of chat rows:
  each line a conversation rendered with a chat template, its shard carrying the loss mask of the
  assistant's tokens (`parallax.chat`; `chat_template`, `loss_on`), every line checked before anything is
  written;
* `.parquet`: the `text_field` column (pyarrow);
* a saved Hugging Face `datasets` directory (`Dataset.save_to_disk`: `state.json` + `.arrow` files): its
  `text_field` column, read with pyarrow (memory-mapped; the `datasets` library is not needed);
* any other file (`.txt`, `.md`, source code, ...): the whole file is one document (files with a NUL byte
  are skipped as binary); a directory that is not a dataset means every file under it.

**Units.** The inputs are cut into units of about `shard_mb` of input before anything is tokenized: whole
files, grouped; byte ranges of a jsonl file cut at line starts; row groups of a parquet file; row ranges of
an arrow file. Each unit becomes one shard. The cut depends only on the inputs and `shard_mb` (not on the
number of workers), and a unit's shard only on its input and the tokenizer: the same inputs give the same
bytes, with any `workers`.

**Restart.** `prepare.json` (the inputs with their sizes and mtimes, the tokenizer hash, the settings and
the units) is written first; a rerun with the same plan skips the units whose shard is committed (see
`parallax.corpus`) and deletes temporaries a killed run left; a rerun with another plan is refused unless
`overwrite`. The manifest is written last, so a training run never reads an unfinished directory.

**Workers** are processes (`spawn`), each tokenizing whole units with one `tokenizers` thread
(TOKENIZERS_PARALLELISM off): with `workers=1` the main process does the work itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import json
import multiprocessing
import os
import re
import shutil
import time

import numpy as np

from parallax import chat as chat_lib
from parallax import corpus as shard_lib
from parallax import tokenizer as tok_lib
from parallax.errors import ConfigError

PLAN = "prepare.json"
_JSONL = (".jsonl", ".ndjson")  # not .json: a package.json in a source tree is one document
_SOURCE_NAME = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")
_ENCODE_BATCH = 512  # documents per encode_batch call


@dataclasses.dataclass(frozen=True)
class Unit:
    """One shard's worth of input. `kind`: files | jsonl | parquet | arrow; `paths`: the files (several for
    `files`, one otherwise); `start`, `stop`: byte range (jsonl), row groups (parquet), rows (arrow)."""

    source: str
    kind: str  # files | jsonl | chat (a jsonl file of chat rows) | parquet | arrow
    paths: tuple
    start: int = 0
    stop: int = 0
    size: int = 0  # input bytes, for the progress bar


def parse_inputs(specs: list[str]) -> list[tuple[str, str]]:
    """`["web=data/*.jsonl", "code/**/*.py"]` -> [("web", "data/*.jsonl"), ("main", "code/**/*.py")]."""
    out = []
    for spec in specs:
        match = _SOURCE_NAME.match(spec)
        name, pattern = (match.group(1), match.group(2)) if match and not os.path.exists(spec) else ("main", spec)
        out.append((name, os.path.expanduser(pattern)))
    if not out:
        raise ConfigError("--inputs: none given; pass e.g. --inputs='web=data/*.jsonl' --inputs='code=src/**/*.py'")
    return out


def _is_dataset_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json"))


def _files(pattern: str) -> list[str]:
    if os.path.isdir(pattern) and not _is_dataset_dir(pattern):
        found = []
        for dirpath, dirnames, filenames in os.walk(pattern):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            found += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
        return found
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p) or _is_dataset_dir(p))


def _kind(path: str) -> str:
    if _is_dataset_dir(path):
        return "arrow"
    if path.endswith(_JSONL):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "files"


def _pyarrow(path):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ConfigError(f"{path}: reading parquet / datasets files needs pyarrow; pip install pyarrow "
                          "(or parallax[data])") from None
    return pyarrow


def _arrow_files(path: str) -> list[str]:
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    return [os.path.join(path, d["filename"]) for d in state.get("_data_files", [])]


def _arrow_table(path: str):
    pa = _pyarrow(path)
    with pa.memory_map(path) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()


def _check_field(path: str, kind: str, text_field: str) -> None:
    """Every record of a jsonl input (the columns of a parquet / arrow one) has `text_field`: a bad line is an
    error naming `file:line` before anything is written."""
    if kind == "jsonl":
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise ConfigError(f"{path}:{number}: not JSON ({e}); each line must be one JSON object") from None
                    if not isinstance(record, dict) or text_field not in record:
                        keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
                        raise ConfigError(f"{path}:{number}: no {text_field!r} field (it has: {keys}); fix the "
                                          "line, or pass --text_field=NAME")
    elif kind in ("parquet", "arrow"):
        pa = _pyarrow(path)
        files = [path] if kind == "parquet" else _arrow_files(path)  # a dataset without files: nothing to read
        names = (pa.parquet.ParquetFile(path).schema_arrow.names if kind == "parquet" else
                 [n for f in files for n in _arrow_table(f).schema.names])
        if files and text_field not in names:
            raise ConfigError(f"{path}: no {text_field!r} column (it has: {', '.join(names[:8])}); "
                              "pass --text_field=NAME")


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """How chat rows become tokens: the template and what the loss is on (`parallax.chat`)."""

    template: chat_lib.Template
    loss_on: str

    @property
    def masked(self) -> bool:
        return self.loss_on == "assistant"


class ChatRows:
    """The chat settings of a preparation, resolved at its first file of chat rows (a corpus without one
    needs no template)."""

    def __init__(self, tok, spec: str, loss_on: str):
        if loss_on not in chat_lib.LOSS_ON:
            raise ConfigError(f"--loss_on={loss_on}: use one of {', '.join(chat_lib.LOSS_ON)}")
        self.tok, self.spec, self.loss_on, self.settings = tok, spec, loss_on, None

    def resolve(self, path: str) -> ChatSettings:
        if self.settings is None:
            try:
                template = chat_lib.resolve(self.spec, self.tok)
                self.tok.encode_chat("")  # a tokenizer that cannot read a template's special tokens fails here
            except ConfigError as e:
                raise ConfigError(f"{path} holds chat rows, but {e}") from None
            self.settings = ChatSettings(template, self.loss_on)
        return self.settings


def _first_record(path: str):
    """The first non-blank line of a jsonl file, parsed (None if it is not JSON: the check names it)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def _check_chat(path: str, settings: ChatSettings) -> None:
    """Every line of a file of chat rows renders, with the assistant's text found where the loss is on it:
    a bad line is an error naming `file:line` before anything is written."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{path}:{number}: not JSON ({e}); each line must be one JSON object") from None
            if not chat_lib.is_chat(record):
                keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{number}: not a chat row (it has: {keys}); every line of a file of "
                                  "conversations holds 'messages', or 'prompt' and 'completion'")
            try:
                chat_lib.assistant_text(settings.template, record, settings.loss_on)
            except chat_lib.ChatError as e:
                raise ConfigError(f"{path}:{number}: {e}") from None


def plan_units(inputs: list[tuple[str, str]], shard_bytes: int, text_field: str = "text",
               chat: ChatRows | None = None) -> tuple[list, list]:
    """The units (see the module doc) and the input files as (path, size, mtime_ns), in a fixed order.
    `chat`: how to read files of chat rows (without it, a jsonl file must have `text_field` on every line)."""
    units, files = [], []
    for name, pattern in inputs:
        found = _files(pattern)
        if not found:
            raise ConfigError(f"--inputs {name}={pattern}: matches no files; fix the pattern (globs need "
                              "quotes, ** for subdirectories)")
        source_units = []
        group, group_bytes = [], 0
        for path in found:
            kind = _kind(path)
            size = (sum(os.path.getsize(f) for f in _arrow_files(path)) if kind == "arrow" else os.path.getsize(path))
            for f in (_arrow_files(path) if kind == "arrow" else [path]):  # a dataset: each of its files
                files.append((f, os.path.getsize(f), os.stat(f).st_mtime_ns))
            if kind == "files":
                if size == 0:
                    continue
                group.append(path)
                group_bytes += size
                if group_bytes >= shard_bytes:
                    source_units.append(Unit(name, "files", tuple(group), size=group_bytes))
                    group, group_bytes = [], 0
                continue
            first = _first_record(path) if chat is not None and kind == "jsonl" else None
            if isinstance(first, dict) and text_field not in first and chat_lib.is_chat(first):
                kind = "chat"
                _check_chat(path, chat.resolve(path))
            else:
                _check_field(path, kind, text_field)
            source_units += _split_file(name, path, kind, size, shard_bytes)
        if group:
            source_units.append(Unit(name, "files", tuple(group), size=group_bytes))
        if not source_units:
            raise ConfigError(f"--inputs {name}={pattern}: every file it matches is empty; point it at a corpus")
        units += source_units
    return units, files


def _split_file(name, path, kind, size, shard_bytes):
    if kind in ("jsonl", "chat"):
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] + shard_bytes < size:
                f.seek(cuts[-1] + shard_bytes)
                f.readline()  # to the next line start
                if f.tell() >= size:
                    break
                cuts.append(f.tell())
        cuts.append(size)
        return [Unit(name, kind, (path,), a, b, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    if kind == "parquet":
        meta = _pyarrow(path).parquet.ParquetFile(path).metadata
        out, first, acc = [], 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            if acc >= shard_bytes or g == meta.num_row_groups - 1:
                out.append(Unit(name, kind, (path,), first, g + 1, acc))
                first, acc = g + 1, 0
        return out
    out = []  # arrow: row ranges of each of the dataset's files
    for file in _arrow_files(path):
        table = _arrow_table(file)
        rows, nbytes = table.num_rows, max(table.nbytes, 1)
        per_unit = max(1, int(rows * shard_bytes / nbytes))
        out += [Unit(name, kind, (file,), a, min(a + per_unit, rows), int(nbytes * (min(a + per_unit, rows) - a)
                                                                        / max(rows, 1)))
                for a in range(0, rows, per_unit)]
    return out


def read_unit(unit: Unit, text_field: str = "text") -> list:
    """The documents of one unit, in order (empty documents dropped): strings, or a chat unit's rows (dicts)."""
    if unit.kind == "files":
        docs = []
        for path in unit.paths:
            with open(path, "rb") as f:
                data = f.read()
            if data and b"\0" not in data:
                docs.append(data.decode("utf-8", errors="replace"))
        return docs
    if unit.kind in ("jsonl", "chat"):
        (path,) = unit.paths
        with open(path, "rb") as f:
            f.seek(unit.start)
            chunk = f.read(unit.stop - unit.start)
        # Lines end at b"\n" only, as the plan's checks and cuts read them (bytes.splitlines would also cut
        # at a bare b"\r", which JSON allows as whitespace inside a line).
        lines = [line for line in chunk.split(b"\n") if line.strip()]
        docs = []
        for line in lines:
            try:
                record = json.loads(line)
                text = record if unit.kind == "chat" else record[text_field]
            except (ValueError, KeyError, TypeError):
                if unit.kind == "jsonl":
                    _check_field(path, "jsonl", text_field)  # names the file:line (it changed since the plan)
                what = "JSON" if unit.kind == "chat" else f"a JSON object with a {text_field!r} field"
                raise ConfigError(f"{path}: a line in bytes [{unit.start}, {unit.stop}) is not {what} (the file "
                                  f"changed since it was planned; rerun with --overwrite): {line[:80]!r}") from None
            if unit.kind == "chat":
                docs.append(record)
            elif text:
                docs.append(str(text))
        return docs
    if unit.kind == "parquet":
        pq = _pyarrow(unit.paths[0]).parquet
        table = pq.ParquetFile(unit.paths[0]).read_row_groups(list(range(unit.start, unit.stop)),
                                                              columns=[text_field])
        return [t for t in table.column(text_field).to_pylist() if t]
    table = _arrow_table(unit.paths[0]).slice(unit.start, unit.stop - unit.start)
    return [t for t in table.column(text_field).to_pylist() if t]


_WORKER_TOKENIZER = {}


def _tokenizer(spec: str, expected_hash: str):
    """The tokenizer at `spec` (cached per process by its hash), which must be the plan's."""
    if expected_hash not in _WORKER_TOKENIZER:
        tok = tok_lib.load(spec)
        if tok.hash != expected_hash:
            raise ConfigError(f"{spec}: the tokenizer copy has hash {tok.hash[:12]}, not the plan's "
                              f"{expected_hash[:12]}; rerun with --overwrite")
        _WORKER_TOKENIZER[expected_hash] = tok
    return _WORKER_TOKENIZER[expected_hash]


def tokenize_unit(unit: Unit, name: str, spec: str, out_dir: str, dtype: str, text_field: str,
                  tokenizer_hash: str, chat: ChatSettings | None = None) -> dict:
    """Reads, tokenizes and writes one unit as shard `name`; returns its manifest entry."""
    tok = _tokenizer(spec, tokenizer_hash)
    if unit.kind == "chat":
        return _tokenize_chat(unit, name, tok, out_dir, dtype, chat)
    texts = read_unit(unit, text_field)
    docs = []
    for i in range(0, len(texts), _ENCODE_BATCH):
        docs += [np.asarray(d, shard_lib.DTYPES[dtype]) for d in tok.documents(texts[i : i + _ENCODE_BATCH])]
    entry = shard_lib.write_shard(out_dir, name, docs, dtype)
    return {**entry, "source": unit.source}


def _tokenize_chat(unit: Unit, name: str, tok, out_dir: str, dtype: str, chat: ChatSettings) -> dict:
    """A unit of chat rows as shard `name`: each row's ids, and under loss_on='assistant' its loss mask."""
    docs, masks = [], []
    for record in read_unit(unit):
        try:
            ids, mask = chat_lib.tokenize(tok, chat.template, record, chat.loss_on)
        except chat_lib.ChatError as e:
            _check_chat(unit.paths[0], chat)  # names the file:line (the file changed since the plan)
            raise ConfigError(f"{unit.paths[0]}: a row in bytes [{unit.start}, {unit.stop}): {e}") from None
        docs.append(np.asarray(ids, shard_lib.DTYPES[dtype]))
        masks.append(mask)
    entry = shard_lib.write_shard(out_dir, name, docs, dtype, masks if chat.masked else None)
    return {**entry, "source": unit.source}


def _worker_init():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def prepare(inputs: list[str], out_dir: str, tokenizer: str = "bytes", *, workers: int = 1, shard_mb: float = 64,
            text_field: str = "text", chat_template: str = "", loss_on: str = "assistant", overwrite: bool = False,
            progress: bool = True, log=print) -> dict:
    """Prepares `inputs` (see `parse_inputs`) into the shard directory `out_dir`; returns the manifest.
    Files of chat rows are rendered with `chat_template` ('' the tokenizer's own, a `parallax.chat.NAMED` one,
    or a .jinja file), their loss on the assistant's tokens or on `all` (`loss_on`)."""
    if workers < 1:
        raise ConfigError(f"--workers={workers}: must be >= 1")
    if shard_mb <= 0:
        raise ConfigError(f"--shard_mb={shard_mb}: must be > 0")
    pairs = parse_inputs(inputs)
    tok = tok_lib.ByteTokenizer(256) if tokenizer in ("", "bytes") else tok_lib.load(tokenizer, key="--tokenizer")
    if tok.eos_id is None:
        raise ConfigError(f"--tokenizer={tokenizer}: it has no eos token to end documents with; use a tokenizer "
                          "with one (train_tokenizer.py writes <|endoftext|>), or bytes")
    dtype = shard_lib.dtype_for(tok.vocab_size)
    chat_rows = ChatRows(tok, chat_template, loss_on)
    units, files = plan_units(pairs, int(shard_mb * (1 << 20)), text_field, chat_rows)
    chat = chat_rows.settings
    if chat is None and chat_template:
        raise ConfigError(f"--chat_template={chat_template}: no input holds chat rows (jsonl lines with 'messages', "
                          "or 'prompt' and 'completion'); drop the flag or point --inputs at conversations")
    names, counters = [], {}
    for unit in units:
        names.append(f"{unit.source}-{counters.get(unit.source, 0):05d}")
        counters[unit.source] = counters.get(unit.source, 0) + 1
    plan = {"format": shard_lib.FORMAT, "tokenizer_hash": tok.hash, "dtype": dtype, "text_field": text_field,
            "shard_mb": shard_mb, "inputs": [list(p) for p in pairs], "files": [list(f) for f in files],
            "units": [dataclasses.asdict(u) | {"paths": list(u.paths), "name": n} for u, n in zip(units, names)]}
    if chat is not None:
        plan["chat"] = _chat_meta(chat)
    masked = [u.kind == "chat" and chat.masked for u in units]
    _claim(out_dir, plan, overwrite)
    todo = [i for i, n in enumerate(names) if not shard_lib.committed(out_dir, n, dtype, masked[i])]
    entries = {i: shard_lib.shard_entry(out_dir, names[i], dtype, None if units[i].kind == "chat" else tok.eos_id,
                                        masked[i]) | {"source": units[i].source}
               for i in range(len(units)) if i not in todo}  # a damaged one fails here, before the copy below
    tok.copy_to(os.path.join(out_dir, "tokenizer"))
    spec = os.path.join(out_dir, "tokenizer")  # what the workers load: the copy, hash for hash the same
    if entries:
        log(f"prepare: {len(entries)} of {len(units)} shards already done in {out_dir}; continuing")
    total = sum(units[i].size for i in todo)
    log(f"prepare: {len(files)} files, {len(units)} shards ({len(todo)} to write), {total / 1e6:,.1f} MB of input, "
        f"{workers} worker{'s' * (workers > 1)}; {tok.describe()}")
    start, tokens = time.perf_counter(), 0
    bar = _progress_bar(total, progress)
    try:
        for i, entry in _run(todo, units, names, spec, out_dir, dtype, text_field, workers, tok.hash, chat):
            entries[i] = entry
            tokens += entry["tokens"]
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{tokens:,} tokens, {rate:,.0f} tok/s", refresh=False)
            bar.update(units[i].size)
    finally:
        bar.close()
    manifest = _manifest(tok, dtype, pairs, [entries[i] for i in range(len(units))], chat)
    tmp = os.path.join(out_dir, shard_lib.MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, shard_lib.MANIFEST))
    seconds = time.perf_counter() - start
    log(f"prepare: wrote {out_dir}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
        f"{len(units)} shards ({tokens / max(seconds, 1e-9):,.0f} tok/s over {seconds:.1f} s)")
    return manifest


def _progress_bar(total, enabled):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not enabled, mininterval=1.0)


def _run(todo, units, names, spec, out_dir, dtype, text_field, workers, tokenizer_hash, chat):
    """Yields (unit index, entry) as units finish: in this process for one worker, else in a pool."""
    if workers == 1:
        for i in todo:
            yield i, tokenize_unit(units[i], names[i], spec, out_dir, dtype, text_field, tokenizer_hash, chat)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init) as pool:
        futures = {pool.submit(tokenize_unit, units[i], names[i], spec, out_dir, dtype, text_field,
                               tokenizer_hash, chat): i
                   for i in todo}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()


def _claim(out_dir: str, plan: dict, overwrite: bool) -> None:
    """Makes `out_dir` this plan's: new, or the same plan's restart (temporaries removed), or, with
    `overwrite`, emptied. Another plan's directory is refused before anything is written."""
    plan_path = os.path.join(out_dir, PLAN)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        previous = None
        if os.path.isfile(plan_path):
            with open(plan_path) as f:
                previous = json.load(f)
        if previous is None:  # never delete what a preparation did not write
            raise ConfigError(f"--output={out_dir}: not empty and not a preparation's directory (no {PLAN}); pass "
                              "a new or empty --output")
        if previous != plan and not overwrite:
            raise ConfigError(f"--output={out_dir}: was prepared from other inputs or settings (its {PLAN} "
                              "differs); pass a new --output, or --overwrite to replace it")
        if previous != plan:
            shutil.rmtree(out_dir)
        else:
            for name in os.listdir(out_dir):
                if name.endswith(".tmp"):
                    os.remove(os.path.join(out_dir, name))
            return
    os.makedirs(out_dir, exist_ok=True)
    with open(plan_path + ".tmp", "w") as f:
        json.dump(plan, f, indent=1)
    os.replace(plan_path + ".tmp", plan_path)


def _chat_meta(chat: ChatSettings) -> dict:
    return {"template": chat.template.name, "template_sha256": chat.template.sha256, "loss_on": chat.loss_on}


def _manifest(tok, dtype, pairs, entries, chat=None) -> dict:
    sources = {}
    for name, pattern in pairs:
        sources.setdefault(name, {"inputs": [], "documents": 0, "tokens": 0, "shards": 0})["inputs"].append(pattern)
    for entry in entries:
        s = sources[entry["source"]]
        s["documents"] += entry["documents"]
        s["tokens"] += entry["tokens"]
        s["shards"] += 1
    masked = any(e.get("mask") for e in entries)
    return {"format": shard_lib.FORMAT_MASKED if masked else shard_lib.FORMAT, "tokenizer": tok.meta(),
            "dtype": dtype, "documents": sum(e["documents"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries), "sources": sources, "shards": entries,
            **({"chat": _chat_meta(chat)} if chat is not None else {})}


def iter_texts(inputs: list[str], text_field: str = "text", max_bytes: int = 0):
    """The documents of `inputs` (see `parse_inputs`) in order, as strings; at most about `max_bytes` of
    input when it is > 0 (e.g. to train a tokenizer on a sample). Bad inputs fail before the first text."""
    units, _ = plan_units(parse_inputs(inputs), 1 << 26, text_field)

    def texts():
        read = 0
        for unit in units:
            for text in read_unit(unit, text_field):
                yield text
                read += len(text.encode("utf-8"))
                if max_bytes and read >= max_bytes:
                    return
    return texts()
