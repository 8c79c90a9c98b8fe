"""Language-model data: sources, packing into fixed-length rows, per-host batches -> global arrays.

Owns the three sources (``synthetic``, ``text`` bytes, pre-tokenized ``tokens`` files or shard directories), the split into
train / eval documents, the packing of documents into rows of ``seq_len`` tokens, and ``to_global``.

Determinism contract: row ``r`` of the global batch for ``(seed, step, split)`` depends on those four values
and the corpus only -- not on the number of hosts, the host index, or which batches were read before. So
resuming at step ``s`` needs nothing but ``s``, and N hosts each asking for their own slice of the global
batch together hold exactly the batch one host would have read.

Each split is one precomputed stream: the split's documents concatenated (a 1-D token array, memory-mapped
for token files) plus the offset at which each document starts. A row is the window of ``seq_len + 1``
tokens starting at a pseudo-random offset drawn from ``np.random.default_rng([seed, split, step, row])``
(sampler 'random'), or at the next window of the epoch's seeded permutation (sampler 'epoch', see
``make_dataset``); windows cross document boundaries. In every batch (arrays of shape [rows, seq_len]):

* ``inputs`` / ``targets`` (int32): the window's tokens and the tokens one place later;
* ``segment_ids`` (int32): 1, 2, ... for the documents inside the row, 0 for padding;
* ``positions`` (int32): the token's position within its document's piece of the row: 0 at the row's first
  token (also when the window begins mid-document) and at each new document, counting up by one within a
  document. So every position is below ``seq_len``, which the models check against their position tables;
* ``weights`` (float32): 1.0 where the target is the next token of the same document, else 0.0 (padding,
  and the last token of each document); times the target's loss mask where the corpus has one (chat shards
  trained on the assistant's tokens only, ``parallax.chat``): a corpus without one packs as it always did.

Why positions count from the window, not from the document's true start: a row only ever shows the model
its own ``seq_len`` tokens (attention never reaches the part of a document before the window), exactly as
sampling's sliding window does (``parallax.sample`` numbers its window 0, 1, ...), and as the usual
learned-position decoders train. Counting from the true start would instead hand a learned position table
(of ``max_positions`` rows, at least ``seq_len``) positions up to the length of the longest document: past
the table the lookup reads nothing (a NaN loss), and the rows from ``seq_len`` on would be trained only on
windows that start mid-document, which sampling never produces. Clamping (every late token sharing the last
row) or wrapping (a jump back to position 0 mid-document, which the table otherwise sees only at document
starts) would both feed the table positions that mean something else at sampling time. Rotary models see
the same scores up to fp32 rounding (less of it: smaller positions, smaller angles): shifting all of a
document's positions by one offset leaves every q.k rotation angle difference unchanged, and the mask
(same segment, kv position <= q position) is unchanged too.

Padding appears only when a split's stream is shorter than ``seq_len + 1`` tokens, which only an eval split can
be: a train stream that short is a ``DataError`` (the training launcher refuses a short eval split too).

Shard directories (``launch/prepare_data.py``, format in ``parallax.corpus``) read as the token file of the
same documents would: one stream over all shards (memory-mapped and indexed lazily), its tail the eval
split. ``mixture`` ("web=0.7,code=0.3") keeps one stream per source instead (each with its own eval tail)
and draws each row's source by weight (``Dataset._mixture_row``): still a function of (seed, step, row).

Token files: ``NAME.uint16.bin`` / ``NAME.uint32.bin`` are raw little-endian arrays of that dtype;
``NAME.npy`` is a 1-D integer numpy array (any integer dtype). The first load scans the file once (smallest and
largest id, document ends) and caches that in ``<file>.index.npz`` beside it, keyed by the file's size and
mtime and the eos id, so later starts do not rescan. Documents end with ``eos_id``, which belongs to
the document it ends; the eval split is the last ``eval_fraction`` of the tokens, cut at a document start.
"""

import contextlib
import dataclasses
import functools
import hashlib
import os
import tempfile

import jax
import numpy as np

from parallax.errors import ConfigError

SPLITS = ("train", "eval")
_TOKEN_DTYPES = {".uint16.bin": np.dtype("<u2"), ".uint32.bin": np.dtype("<u4")}
_SCAN_CHUNK = 1 << 24  # tokens per pass when scanning a token file for eos and the largest id


class DataError(ValueError):
    """A data configuration or corpus problem; the message names the bad value and the fix."""


@dataclasses.dataclass(frozen=True)
class _Stream:
    """One split: its documents concatenated, and the offset where each document starts (starts[0] == 0)."""

    tokens: np.ndarray  # [n_tokens], any integer dtype, possibly a memmap
    starts: np.ndarray  # [n_docs] int64, strictly increasing

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_docs(self) -> int:
        return len(self.starts)

    has_mask = False  # a token file or generated documents: every target is trained

    def window(self, offset: int, n: int):
        """Tokens [offset, offset + n) (fewer at the end) and the document starts inside them, relative to
        `offset`, with 0 first (the document the window begins in). `shards.ShardStream` has the same."""
        hi = min(offset + n, len(self.tokens))
        i0, i1 = np.searchsorted(self.starts, offset, side="right"), np.searchsorted(self.starts, hi, side="left")
        return (np.asarray(self.tokens[offset:hi]),
                np.concatenate([[0], np.asarray(self.starts[i0:i1], np.int64) - offset]))


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Several sources of one split drawn by weight (`data.mixture`): source k's stream, name and weight
    (normalised to sum 1); a source without documents in this split is None."""

    names: tuple
    weights: tuple
    streams: tuple

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams if s is not None)

    @property
    def num_docs(self) -> int:
        return sum(s.num_docs for s in self.streams if s is not None)


def _concat(docs, eos_id, dtype):
    lengths = np.array([len(d) + (eos_id is not None) for d in docs], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for doc, start, length in zip(docs, starts, lengths):
        tokens[start : start + len(doc)] = doc
        if eos_id is not None:
            tokens[start + length - 1] = eos_id
    return _Stream(tokens, starts)


def _synthetic(seq_len, vocab_size, seed, eval_fraction, eos_id):
    """Documents that are a short random pattern repeated, or an arithmetic sequence mod vocab."""
    rng = np.random.default_rng([seed, 7])
    n_ids = vocab_size - (eos_id is not None)  # ids drawn from [0, n_ids), shifted past eos_id
    budget, docs = max(1 << 18, 64 * seq_len), []
    while budget > 0:
        length = int(rng.integers(16, max(17, 2 * seq_len + 1)))
        if rng.random() < 0.5:
            pattern = rng.integers(0, n_ids, int(rng.integers(2, 9)))
            doc = np.resize(pattern, length)
        else:
            doc = (rng.integers(0, n_ids) + rng.integers(1, 9) * np.arange(length)) % n_ids
        if eos_id is not None:
            doc = doc + (doc >= eos_id)
        docs.append(doc)
        budget -= length
    n_train = len(docs) - int(round(len(docs) * eval_fraction))
    return docs[:n_train], docs[n_train:]


def _is_eval(relpath, eval_fraction):
    """Stable per-document split: a hash of the path, so adding files never moves other files."""
    digest = hashlib.sha1(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < eval_fraction


def _text(path, eval_fraction, max_bytes):
    """Every file under ``path`` (sorted, recursive) is one document of bytes; binary files are skipped."""
    stdlib = path == ""
    root = os.path.dirname(os.__file__) if stdlib else path
    if not os.path.isdir(root):
        raise DataError(f"text path {path!r} is not a directory; pass a directory of text files, "
                        "or path='' for the Python standard library sources")
    train, held_out, total = [], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and d not in ("__pycache__", "site-packages", "dist-packages"))
        for name in sorted(filenames):
            if total >= max_bytes:
                return train, held_out
            if name.startswith(".") or (stdlib and not name.endswith(".py")):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read(max_bytes - total)
            if not data or b"\0" in data:
                continue
            total += len(data)
            relpath = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            doc = np.frombuffer(data, np.uint8)
            (held_out if _is_eval(relpath, eval_fraction) else train).append(doc)
    return train, held_out


def _open_tokens(path):
    if path.endswith(".npy"):
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise DataError(f"token file {path!r} is not a .npy file (no NUMPY header); rewrite it with "
                                "np.save(path, tokens) from a 1-D integer array")
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:  # not a .npy, truncated, or pickled objects
            raise DataError(f"token file {path!r} is not a readable .npy array ({str(e).splitlines()[0]}); "
                            "rewrite it with np.save(path, tokens) from a 1-D integer array") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"token file {path!r} holds {tokens.dtype}{list(tokens.shape)}; "
                            "save a 1-D integer array")
        return tokens
    for suffix, dtype in _TOKEN_DTYPES.items():
        if path.endswith(suffix):
            if os.path.getsize(path) % dtype.itemsize:
                raise DataError(f"token file {path!r} size is not a multiple of {dtype.itemsize} bytes; "
                                f"is it really {dtype.name}?")
            return np.memmap(path, dtype=dtype, mode="r")
    raise DataError(f"token file {path!r} has an unknown dtype; name it NAME.uint16.bin, "
                    "NAME.uint32.bin or NAME.npy")


def _scan_tokens(tokens, eos_id):
    """One pass over a token file: its smallest and largest id and the end (one past) of each eos."""
    lowest, highest, ends = None, None, []
    for lo in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[lo : lo + _SCAN_CHUNK])
        lo_id, hi_id = int(chunk.min()), int(chunk.max())
        lowest = lo_id if lowest is None else min(lowest, lo_id)
        highest = hi_id if highest is None else max(highest, hi_id)
        ends.append(lo + np.flatnonzero(chunk == eos_id) + 1)
    return lowest, highest, np.concatenate(ends).astype(np.int64)


def _token_index(path, tokens, eos_id):
    """`_scan_tokens`, cached beside the file in ``PATH.index.npz`` (keyed by the file's size, mtime and the
    eos id), so that a restart does not rescan a corpus of billions of tokens. A read-only directory just
    means no cache; a stale or unreadable cache is rebuilt."""
    index_path = path + ".index.npz"
    stat = os.stat(path)
    key = np.array([stat.st_size, stat.st_mtime_ns, eos_id], np.int64)
    try:
        with np.load(index_path) as cached:
            if np.array_equal(cached["key"], key):
                return int(cached["lowest"]), int(cached["highest"]), cached["ends"]
    except (OSError, ValueError, KeyError, EOFError):  # none yet, or unreadable: rebuild
        pass
    lowest, highest, ends = _scan_tokens(tokens, eos_id)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".tmp", prefix=os.path.basename(index_path) + ".",
                                   dir=os.path.dirname(os.path.abspath(path)))
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide the index from the other users of a corpus
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=key, lowest=lowest, highest=highest, ends=ends)
        os.replace(tmp, index_path)  # atomic: a concurrent reader sees the old index or the whole new one
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return lowest, highest, ends


_TOKEN_FILE_SUFFIXES = (".bin", ".npy")


def check_token_paths(path: str) -> None:
    """Each comma-separated path of source='tokens' exists: a DataError (`path=...: ...`) naming the first that
    does not, as the shard directory or the token file its name says it is meant to be."""
    paths = [p.strip() for p in str(path).split(",") if p.strip()]
    if not paths:
        raise DataError("path='': source='tokens' needs a path: a shard directory (launch/prepare_data.py) or a "
                        "token file")
    for p in paths:
        if not os.path.exists(p):
            if p.endswith(_TOKEN_FILE_SUFFIXES):
                raise DataError(f"path={p!r}: no such token file; pass the path of a NAME.uint16.bin, NAME.uint32.bin "
                                "or NAME.npy file")
            raise DataError(f"path={p!r}: no such directory; pass a shard directory that launch/prepare_data.py wrote")


def _token_streams(path, vocab_size, eval_fraction, eos_id):
    """Memory-maps a token file, checks every id against vocab_size, splits off the tail for eval."""
    if eos_id is None:
        raise DataError("source='tokens' needs eos_id (the id that ends each document); pass eos_id=...")
    if not 0 <= eos_id < vocab_size:
        raise DataError(f"eos_id={eos_id} is outside the vocab [0, {vocab_size}); "
                        "pass the tokenizer's eos id")
    if not os.path.isfile(path):
        raise DataError(f"token file {path!r} is not a file; pass the path of a NAME.uint16.bin, "
                        "NAME.uint32.bin or NAME.npy file")
    tokens = _open_tokens(path)
    if len(tokens) == 0:
        raise DataError(f"token file {path!r} is empty; write tokens to it first")
    lowest, highest, ends = _token_index(path, tokens, eos_id)
    if highest >= vocab_size or lowest < 0:
        bad = highest if highest >= vocab_size else lowest
        raise DataError(f"token file {path!r} holds id {bad}, outside vocab_size={vocab_size}; "
                        "raise vocab_size to the tokenizer's vocab size")
    starts = np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)
    later = starts[starts >= len(tokens) * (1.0 - eval_fraction)]
    cut = int(later[0]) if eval_fraction > 0 and len(later) else len(tokens)
    train = _Stream(tokens[:cut], starts[starts < cut])
    held_out = _Stream(tokens[cut:], starts[starts >= cut] - cut) if cut < len(tokens) else None
    return train, held_out


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Packed LM batches for ``(seed, step, split)``; build it with ``make_dataset``."""

    source: str
    seq_len: int
    global_batch_size: int
    vocab_size: int
    seed: int
    streams: dict  # split -> _Stream, or None when the split has no documents
    sampler: str = "random"  # see make_dataset

    def batch(self, step: int, split: str = "train", *, process_index: int = 0,
              process_count: int = 1, rows: tuple[int, int] | None = None, source: str | None = None) -> dict:
        """This host's rows of the global batch: each array is [rows, seq_len].

        With ``rows=(lo, hi)`` the host gets global rows ``[lo, hi)`` (use ``host_rows`` to ask the batch
        sharding which rows this host's devices hold); otherwise host ``i`` of ``process_count`` gets rows
        ``[i * B/process_count, (i+1) * B/process_count)``. ``source`` (a mixture's source name) draws every
        row from that source alone (per-source eval).
        """
        if split not in SPLITS:
            raise DataError(f"split={split!r} is unknown; use one of {SPLITS}")
        if process_count < 1 or self.global_batch_size % process_count:
            raise DataError(f"global_batch_size={self.global_batch_size} is not divisible by "
                            f"process_count={process_count}; make the batch a multiple of the host count")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index={process_index} is outside [0, {process_count}); "
                            "pass jax.process_index()")
        if step < 0:
            raise DataError(f"step={step} is negative; steps count from 0")
        stream = self.streams[split]
        if source is not None:
            if not isinstance(stream, Mixture) or source not in stream.names:
                raise DataError(f"source={source!r} is not a source of this corpus's mixture")
            stream = stream.streams[stream.names.index(source)]
        if stream is None:
            raise DataError(f"the {split!r} split of this {self.source!r} corpus has no documents; "
                            "raise eval_fraction or add documents")
        if rows is None:
            per_host = self.global_batch_size // process_count
            rows = (process_index * per_host, (process_index + 1) * per_host)
        if not 0 <= rows[0] < rows[1] <= self.global_batch_size:
            raise DataError(f"rows={rows} is not a row range of the global batch of {self.global_batch_size}")
        if not isinstance(stream, Mixture):
            return _pack(stream, self.seq_len, [self._offset(stream, step, split, r) for r in range(*rows)])
        parts = [self._mixture_row(stream, step, split, r) for r in range(*rows)]
        packed = [_pack(stream.streams[k], self.seq_len, [offset]) for k, offset in parts]
        return {key: np.concatenate([p[key] for p in packed]) for key in packed[0]}

    def row_sources(self, step: int, split: str = "train", rows: tuple[int, int] | None = None) -> list[str]:
        """The mixture source of each row of ``batch(step, split, rows=rows)`` (all rows by default)."""
        stream = self.streams[split]
        if not isinstance(stream, Mixture):
            raise DataError("this corpus has no mixture (config.data.mixture is empty)")
        rows = rows or (0, self.global_batch_size)
        return [stream.names[self._mixture_row(stream, step, split, r)[0]] for r in range(*rows)]

    def _offset(self, stream, step, split, row, index=None, key=()):
        """The window start of `row`. `index` (the row's number among its source's rows) and `key` (the
        source, mixed into the random draw) are a mixture's; a single stream's draws are unchanged by them."""
        n_starts = len(stream) - self.seq_len  # windows of seq_len + 1 tokens that fit
        if n_starts <= 0:
            return 0
        if self.sampler == "epoch":  # row `row` of `step` is window number step * B + row of the epoch order
            n_windows = _num_windows(len(stream), self.seq_len)
            g = step * self.global_batch_size + row if index is None else index
            epoch, i = divmod(g, n_windows)
            return int(_epoch_order(self.seed, SPLITS.index(split), epoch, n_windows, *key)[i]) * self.seq_len
        rng = np.random.default_rng([self.seed, SPLITS.index(split), step, row, *key])
        return int(rng.integers(0, n_starts))

    def _mixture_row(self, mixture, step, split, row):
        """(source index, window start) of a mixture's row: the random sampler draws the source by weight
        from the row's own seed; the epoch sampler deals rows out by `_mixture_slot` (exact shares), and
        each source reads its windows in its own epoch order."""
        active = [k for k, (w, s) in enumerate(zip(mixture.weights, mixture.streams)) if w > 0 and s is not None]
        if not active:
            raise DataError(f"no source of this mixture has documents in the {split!r} split; raise eval_fraction")
        weights = [mixture.weights[k] for k in active]
        if self.sampler == "epoch":
            j, index = _mixture_slot(weights, step * self.global_batch_size + row)
        else:
            u = np.random.default_rng([self.seed, SPLITS.index(split), step, row, 1 << 20]).random()
            cumulative = np.cumsum(weights) / sum(weights)
            j, index = min(int(np.searchsorted(cumulative, u, side="right")), len(weights) - 1), None
        k = active[j]
        return k, self._offset(mixture.streams[k], step, split, row, index, key=(k + 1,))

    def epoch(self, step: int) -> float:
        """Epochs of the train split consumed before `step`: rows read / train windows (exact for the
        epoch sampler without a mixture; the random sampler's expected coverage is lower)."""
        windows = _num_windows(len(self.streams["train"]), self.seq_len)
        return step * self.global_batch_size / windows

    @property
    def mixture_sources(self) -> tuple:
        """The names of the mixture's sources with eval documents (per-source eval), else ()."""
        stream = self.streams["eval"]
        if not isinstance(stream, Mixture):
            return ()
        return tuple(n for n, s in zip(stream.names, stream.streams) if s is not None and len(s) > self.seq_len)

    def describe(self) -> str:
        """One line: the source, the number of documents, and the train / eval token counts."""
        streams = [s for s in self.streams.values() if s is not None]
        n_tokens = {k: 0 if s is None else len(s) for k, s in self.streams.items()}
        line = (f"{self.source}: {sum(s.num_docs for s in streams)} documents, "
                f"{n_tokens['train']} train / {n_tokens['eval']} eval tokens, "
                f"rows of {self.seq_len} tokens, global batch {self.global_batch_size}")
        train = self.streams["train"]
        if isinstance(train, Mixture):
            line += "; mixture " + ", ".join(f"{n}={w:.3g}" for n, w in zip(train.names, train.weights))
        return line


def _mixture_slot(weights, g: int) -> tuple[int, int]:
    """Row `g` of a mixture -> (its source k, its number among source k's rows), dealt out exactly: of rows
    0..g, source 0 takes floor((g + 1) * w0) (Bresenham's line), source 1 the same share of the rest, and so
    on, the last source taking what is left. A pure function of g, so a resumed run needs only the step;
    each source's share is exact to a row. `weights` are all positive."""
    rest = float(sum(weights))
    for k, w in enumerate(weights[:-1]):
        p = w / rest if rest > 0 else 0.0
        taken_before, taken_through = int(np.floor(g * p)), int(np.floor((g + 1) * p))
        if taken_through > taken_before:
            return k, taken_before
        g, rest = g - taken_before, rest - w
    return len(weights) - 1, g


def _num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens starting every seq_len tokens (so each target is in exactly one)."""
    return max((n_tokens - 1) // seq_len, 1)


@functools.lru_cache(maxsize=16)
def _epoch_order(seed: int, split: int, epoch: int, n_windows: int, *source: int) -> np.ndarray:
    """The epoch's seeded permutation of the window numbers (a pure function of its arguments; `source`:
    a mixture's source, 1-based)."""
    order = np.random.default_rng([seed, split, epoch, *source]).permutation(n_windows)
    order.flags.writeable = False
    return order


def _pack(stream, seq_len, offsets):
    """Rows of seq_len tokens starting at each offset (padded past the stream's end); see module doc."""
    rows = [_pack_row(*stream.window(int(o), seq_len + 1), seq_len,
                      stream.loss_mask(int(o), seq_len + 1) if stream.has_mask else None) for o in offsets]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _pack_row(tokens, starts, seq_len, mask=None):
    """One row from a window's tokens (at most seq_len + 1), its document starts (0 first) and, where the
    corpus has one, its loss mask (1: the token is a training target)."""
    idx = np.arange(seq_len + 1)
    valid = idx < len(tokens)
    padded = np.zeros(seq_len + 1, np.int32)
    padded[: len(tokens)] = tokens
    doc = np.searchsorted(starts, idx, side="right") - 1  # the document of each token, 0 = the row's first
    positions = idx - starts[doc]  # from the document's first token in the row
    real = valid[:-1]
    weights = valid[1:] & (doc[1:] == doc[:-1])
    if mask is not None:
        targets_mask = np.zeros(seq_len + 1, bool)
        targets_mask[: len(mask)] = mask
        weights &= targets_mask[1:]  # weight t trains the prediction of token t + 1
    return {
        "inputs": np.where(real, padded[:-1], 0).astype(np.int32),
        "targets": np.where(valid[1:], padded[1:], 0).astype(np.int32),
        "segment_ids": np.where(real, doc[:-1] + 1, 0).astype(np.int32),
        "positions": np.where(real, positions[:-1], 0).astype(np.int32),
        "weights": weights.astype(np.float32),
    }


def parse_mixture(text: str) -> dict:
    """``"web=0.7,code=0.3"`` -> {"web": 0.7, "code": 0.3} (weights >= 0, any positive sum; normalised later)."""
    weights = {}
    for item in [i.strip() for i in str(text).split(",") if i.strip()]:
        name, eq, value = item.partition("=")
        try:
            weight = float(value) if eq and name.strip() else None
        except ValueError:
            weight = None
        if weight is None or not np.isfinite(weight) or weight < 0 or name.strip() in weights:
            raise DataError(f"mixture={text!r}: cannot read {item!r}; write NAME=WEIGHT pairs with distinct names "
                            "and weights >= 0, e.g. mixture='web=0.7,code=0.3'")
        weights[name.strip()] = weight
    if weights and sum(weights.values()) <= 0:
        raise DataError(f"mixture={text!r}: the weights sum to 0; give at least one source a positive weight")
    return weights


def _tail_cut(stream_len, first_start_at_or_after, eval_fraction):
    """Where the eval tail begins: the first document start at or after (1 - eval_fraction) of the tokens."""
    if eval_fraction <= 0:
        return stream_len
    later = first_start_at_or_after(stream_len * (1.0 - eval_fraction))
    return stream_len if later is None else later


def _shard_streams(paths, vocab_size, eval_fraction, eos_id, tokenizer_hash, mixture):
    """The train and eval streams of shard directories (``parallax.corpus``): all shards in order as one
    stream, its tail cut off for eval (as a token file of the same documents would be); with a mixture, one
    such stream per source, each with its own eval tail."""
    from parallax import corpus as shard_lib

    by_source, hashes, in_order = {}, {}, []
    for directory in paths:
        try:
            manifest = shard_lib.read_manifest(directory)
        except shard_lib.ShardError as e:
            raise DataError(str(e)) from None
        tok = manifest["tokenizer"]
        hashes[directory] = tok["hash"]
        if tokenizer_hash is not None and tok["hash"] != tokenizer_hash:
            raise DataError(f"shard directory {directory!r} was tokenized by another tokenizer ({tok['kind']}, hash "
                            f"{tok['hash'][:12]}) than this run's (hash {tokenizer_hash[:12]}); prepare it again with "
                            f"this tokenizer, or train with tokenizer={directory}/tokenizer")
        if eos_id is not None and tok.get("eos_id") != eos_id:
            raise DataError(f"eos_id={eos_id}, but shard directory {directory!r} ends documents with "
                            f"{tok.get('eos_id')}; drop eos_id (it comes from the tokenizer)")
        for entry in manifest["shards"]:
            shard = shard_lib.Shard(directory, entry, manifest["dtype"])
            try:
                shard.check()
            except shard_lib.ShardError as e:
                raise DataError(str(e)) from None
            if entry["tokens"] and entry["highest"] >= vocab_size:
                raise DataError(f"shard {shard.path!r} holds id {entry['highest']}, outside vocab_size={vocab_size}; "
                                "raise model.vocab_size to the tokenizer's (or 0: from the tokenizer)")
            by_source.setdefault(entry.get("source", ""), []).append(shard)
            in_order.append(shard)
    if len(set(hashes.values())) > 1:
        raise DataError(f"the shard directories {sorted(hashes)} were tokenized by different tokenizers; "
                        "prepare them with one tokenizer")
    for name, shards in by_source.items():
        if not sum(s.n_tokens for s in shards):
            raise DataError(f"source {name!r} of {paths} has no tokens; drop it from the inputs or the mixture")

    def split(shards):
        whole = shard_lib.ShardStream(shards)
        cut = _tail_cut(len(whole), whole.first_start_at_or_after, eval_fraction)
        train = shard_lib.ShardStream(shards, 0, cut)
        return train, (shard_lib.ShardStream(shards, cut, len(whole)) if cut < len(whole) else None)

    if not mixture:
        return split(in_order)  # every shard in manifest order, directory after directory
    unknown = sorted(set(mixture) - set(by_source))
    if unknown:
        raise DataError(f"mixture source {unknown[0]!r} is not in {paths} (its sources: "
                        f"{', '.join(sorted(by_source))}); name sources as launch/prepare_data.py --inputs NAME=GLOB did")
    names = tuple(n for n in mixture if mixture[n] > 0)
    total = sum(mixture[n] for n in names)
    weights = tuple(mixture[n] / total for n in names)
    parts = [split(by_source[n]) for n in names]
    return tuple(Mixture(names, weights, tuple(p[i] for p in parts)) for i in range(2))


def check_source(section, vocab_size: int) -> None:
    """The `config.data` choices a plan can check before any file is read: byte-level text needs 256 ids."""
    if section.source == "text" and vocab_size < 256:
        raise ConfigError(f"config.model.vocab_size={vocab_size}: byte-level text needs vocab_size >= 256")


def make_dataset(source: str, path: str = "", *, seq_len: int, global_batch_size: int, seed: int,
                 vocab_size: int, eval_fraction: float = 0.05, eos_id: int | None = None,
                 max_bytes: int = 64 << 20, sampler: str = "random", mixture: str = "",
                 tokenizer_hash: str | None = None) -> Dataset:
    """Loads ``source`` ('synthetic', 'text' or 'tokens'; see the module doc) and returns a Dataset.

    For 'tokens', ``path`` is a token file or one or more shard directories (comma-separated) that
    ``launch/prepare_data.py`` wrote; ``mixture`` (``"web=0.7,code=0.3"``) then draws rows from their sources by
    weight, and ``tokenizer_hash`` (the run's tokenizer) must be the one the shards were made with.

    ``eos_id`` is required for 'tokens'; for 'synthetic' and 'text' it is optional and, when given, appended
    to every document. 'text' reads at most ``max_bytes`` bytes of files. ``sampler``: 'random' draws each
    row's window start independently (with replacement); 'epoch' cuts the split into windows starting every
    ``seq_len`` tokens and reads them in a seeded permutation per epoch, each exactly once per epoch (global
    row ``step * global_batch_size + row`` is that order's entry, so resuming still needs only the step).
    """
    if sampler not in ("random", "epoch"):
        raise DataError(f"sampler={sampler!r} is unknown; use 'random' or 'epoch'")
    if seq_len < 1 or global_batch_size < 1:
        raise DataError(f"seq_len={seq_len}, global_batch_size={global_batch_size}: both must be >= 1")
    if seed < 0:
        raise DataError(f"seed={seed} is negative; use a seed >= 0")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction} must be in [0, 1); e.g. 0.05")
    if source == "synthetic":
        if vocab_size < 16:
            raise DataError(f"vocab_size={vocab_size} is too small for source='synthetic'; use >= 16")
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise DataError(f"eos_id={eos_id} is outside the vocab [0, {vocab_size}); pick an id below it")
        docs = _synthetic(seq_len, vocab_size, seed, eval_fraction, eos_id)
        dtype = np.int32
    elif source == "text":
        if vocab_size < 256:
            raise DataError(f"vocab_size={vocab_size} is too small for source='text' (byte tokens 0..255); "
                            "use vocab_size >= 256")
        if eos_id is not None and not 256 <= eos_id < vocab_size:
            raise DataError(f"eos_id={eos_id} collides with a byte or leaves the vocab; "
                            f"pick an id in [256, {vocab_size})")
        docs = _text(path, eval_fraction, max_bytes)
        dtype = np.uint8 if eos_id is None else np.int32
    elif source == "tokens":
        check_token_paths(path)
        dirs = [p.strip() for p in str(path).split(",") if p.strip()]
        weights = parse_mixture(mixture)
        if dirs and all(os.path.isdir(d) for d in dirs):
            streams = _shard_streams(dirs, vocab_size, eval_fraction, eos_id, tokenizer_hash, weights)
        elif weights or len(dirs) > 1:
            raise DataError(f"path={path!r}: a mixture and several paths need shard directories "
                            "(launch/prepare_data.py); a token file is one source")
        else:
            streams = _token_streams(path, vocab_size, eval_fraction, eos_id)
    else:
        raise DataError(f"source={source!r} is unknown; use 'synthetic', 'text' or 'tokens'")
    if source != "tokens":
        if mixture:
            raise DataError(f"mixture={mixture!r} needs source='tokens' and shard directories (launch/prepare_data.py)")
        streams = tuple(_concat(d, eos_id, dtype) if d else None for d in docs)
    if isinstance(streams[0], Mixture):
        for name, stream in zip(streams[0].names, streams[0].streams):
            if stream is None or len(stream) < seq_len + 1:
                raise DataError(f"mixture source {name!r} has {0 if stream is None else len(stream)} training tokens, "
                                f"fewer than seq_len + 1 = {seq_len + 1}; lower seq_len or add documents")
    elif streams[0] is None or len(streams[0]) == 0:
        raise DataError(f"source={source!r} path={path!r} has no training documents; "
                        "point path at a non-empty corpus or lower eval_fraction")
    if len(streams[0]) < seq_len + 1:  # every row would be mostly padding: a loss of nothing
        raise DataError(f"source={source!r} path={path!r} has {len(streams[0])} training tokens, fewer than "
                        f"seq_len + 1 = {seq_len + 1}; lower seq_len or add documents")
    return Dataset(source, seq_len, global_batch_size, vocab_size, seed, dict(zip(SPLITS, streams)), sampler)


def host_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The global batch rows ``[lo, hi)`` that this host's devices hold under ``sharding``.

    ``global_shape`` is the batch arrays' shape, ``(global_batch_size, seq_len)``.

    It follows the mesh's device layout, not ``jax.process_index()``: hosts that hold replicas of the same
    rows (e.g. when ``seq`` or ``tensor`` spans hosts) load the same rows.
    """
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts = sorted({idx[0].indices(global_shape[0])[:2] for idx in index_map.values()})
    lo, hi = starts[0][0], starts[-1][1]
    covered = sum(b - a for a, b in starts)
    if covered != hi - lo:
        raise DataError(f"this host's devices hold the non-contiguous batch rows {starts}; order the mesh so "
                        "that each host holds one block of rows")
    return lo, hi


def to_global(batch: dict, sharding, global_batch_size: int) -> dict:
    """Turns each host's rows into global jax.Arrays of shape [global_batch_size, seq_len] with ``sharding``
    (one for every array, or a dict of one per key).

    Every host calls it with its own ``Dataset.batch(..., process_index=jax.process_index(), ...)``.
    """
    return {name: jax.make_array_from_process_local_data(sharding[name] if isinstance(sharding, dict) else sharding,
                                                         local,
                                                         (global_batch_size,) + local.shape[1:])
            for name, local in batch.items()}
