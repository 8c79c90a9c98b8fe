"""Real text in: tokenizers (`parallax/tokenizer.py`), corpus preparation (`parallax/prepare.py`), shard
directories (`parallax/corpus.py`) and mixtures (`parallax/data.py`), up to a run that trains on them."""

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax import data as data_lib
from parallax import prepare as prep
from parallax import corpus as shard_lib
from parallax import tokenizer as tok_lib
from parallax.errors import ConfigError
from helpers import ROOT, read_metrics, run_launcher, tiny_config

STDLIB = os.path.dirname(os.__file__)


def _digests(directory):
    """name -> SHA-256 of every file of a shard directory but the plan (which names the inputs' mtimes)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True)):
        if os.path.isfile(path) and not path.endswith(prep.PLAN):
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Inputs of every kind (source files, jsonl, parquet, a datasets directory) and a BPE trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    code = sorted(glob.glob(os.path.join(STDLIB, "json", "*.py")))
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "tokens", "shard", "é", "日本", "\n", "<|endoftext|>"]  # eos as text
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 60)))) for _ in range(400)]
    with open(root / "docs.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
            if i % 50 == 0:
                f.write("\n")  # blank lines are skipped
    inputs = [f"code={STDLIB}/json/*.py", f"docs={root}/docs.jsonl"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[:150]}), root / "part.parquet", row_group_size=40)
    inputs.append(f"pq={root}/part.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": texts[150:300]}).save_to_disk(str(root / "ds"))
    inputs.append(f"hf={root}/ds")
    tok = tok_lib.train_bpe(prep.iter_texts(inputs), 512, str(root / "bpe"), show_progress=False)
    return {"root": root, "inputs": inputs, "texts": texts, "code": code, "tok": tok}


def _decoded_documents(directory, source):
    manifest = shard_lib.read_manifest(directory)
    tok = tok_lib.load(os.path.join(directory, "tokenizer"))
    out = []
    for entry in manifest["shards"]:
        if entry["source"] == source:
            shard = shard_lib.Shard(directory, entry, manifest["dtype"])
            bounds = list(shard.starts) + [shard.n_tokens]
            for a, b in zip(bounds, bounds[1:]):
                ids = np.asarray(shard.tokens[a:b])
                assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
                out.append(tok.decode(ids[:-1]))
    return out


def test_prepare_reads_every_kind_deterministically_with_any_workers_and_restarts(corpus, tmp_path):
    inputs, bpe = corpus["inputs"], str(corpus["root"] / "bpe")
    one = str(tmp_path / "one")
    manifest = prep.prepare(inputs, one, bpe, shard_mb=0.004, progress=False, log=lambda *_: None)
    assert set(manifest["sources"]) == {"code", "docs", "pq", "hf"}
    assert manifest["sources"]["docs"]["shards"] > 1 and manifest["sources"]["pq"]["shards"] == 4  # 40-row groups
    texts = corpus["texts"]
    assert _decoded_documents(one, "docs") == texts  # every line, in order, decoded back exactly
    assert _decoded_documents(one, "pq") == texts[:150]
    assert _decoded_documents(one, "hf") == texts[150:300]
    assert _decoded_documents(one, "code") == [open(p).read() for p in corpus["code"] if os.path.getsize(p)]
    assert manifest["tokenizer"]["hash"] == corpus["tok"].hash
    two = str(tmp_path / "two")
    prep.prepare(inputs, two, bpe, workers=2, shard_mb=0.004, progress=False, log=lambda *_: None)
    assert _digests(one) == _digests(two)  # the same bytes with 2 worker processes

    # A killed run: the manifest not yet written, the last shards uncommitted, a temporary left behind.
    before = _digests(one)
    os.remove(os.path.join(one, shard_lib.MANIFEST))
    last = manifest["shards"][-1]["name"]
    os.remove(os.path.join(one, shard_lib.docs_file(last)))
    with open(os.path.join(one, shard_lib.token_file(last, "uint16") + ".tmp"), "wb") as f:
        f.write(b"torn")
    with pytest.raises(data_lib.DataError, match="did not finish; rerun the same launch/prepare_data.py"):
        data_lib.make_dataset("tokens", one, seq_len=16, global_batch_size=2, seed=0, vocab_size=512)
    logs = []
    prep.prepare(inputs, one, bpe, shard_mb=0.004, progress=False, log=logs.append)
    assert f"{len(manifest['shards']) - 1} of {len(manifest['shards'])} shards already done" in logs[0]
    assert _digests(one) == before

    with pytest.raises(ConfigError, match="was prepared from other inputs or settings"):
        prep.prepare(inputs[:1], one, bpe, progress=False, log=lambda *_: None)
    # The same process, the same output, another tokenizer: the shards are that tokenizer's, not a cached one's.
    prep.prepare(inputs[:2], one, "bytes", overwrite=True, progress=False, log=lambda *_: None)
    assert _decoded_documents(one, "docs") == texts
    assert shard_lib.read_manifest(one)["shards"][0]["highest"] == 256
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "package.json").write_text('{\n  "name": "x"\n}\n')  # in a source tree: a document
    prep.prepare([str(tmp_path / "tree")], str(tmp_path / "tree_out"), progress=False, log=lambda *_: None)
    assert _decoded_documents(str(tmp_path / "tree_out"), "main") == ['{\n  "name": "x"\n}\n']


def _shard_dir(path, docs, shard_of, eos, vocab=300):
    """A shard directory of `docs` (arrays, eos appended), document i in shard shard_of[i]."""
    os.makedirs(path)
    tok = tok_lib.ByteTokenizer(eos)
    entries = []
    for k in range(max(shard_of) + 1):
        mine = [np.append(d, eos) for d, s in zip(docs, shard_of) if s == k]
        entries.append(shard_lib.write_shard(path, f"main-{k:05d}", mine, "uint16") | {"source": "main"})
    tok.copy_to(os.path.join(path, "tokenizer"))
    with open(os.path.join(path, shard_lib.MANIFEST), "w") as f:
        json.dump(prep._manifest(tok, "uint16", [("main", "-")], entries), f)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), cuts=st.lists(st.booleans(), max_size=30),
       seq_len=st.sampled_from([3, 8, 17]), sampler=st.sampled_from(["random", "epoch"]),
       eval_fraction=st.sampled_from([0.0, 0.2]))
def test_a_shard_directory_reads_as_the_token_file_of_the_same_documents(tmp_path_factory, lengths, cuts, seq_len,
                                                                         sampler, eval_fraction):
    """Rows that start mid-document, cross shard boundaries, hold several documents, or run past the end:
    every batch of every split equals the single-file corpus's, key for key."""
    path = tmp_path_factory.mktemp("prop")
    rng = np.random.default_rng(len(lengths))
    docs = [rng.integers(0, 256, n) for n in lengths]
    shard_of = np.cumsum([0] + [int(c) for c in cuts[: len(docs) - 1]]).tolist()
    shard_of += [shard_of[-1]] * (len(docs) - len(shard_of))
    _shard_dir(str(path / "shards"), docs, shard_of, eos=256)
    np.save(path / "all.npy", np.concatenate([np.append(d, 256) for d in docs]).astype(np.int32))
    kw = dict(seq_len=seq_len, global_batch_size=4, seed=3, vocab_size=300, eos_id=256, sampler=sampler,
              eval_fraction=eval_fraction)
    total = sum(lengths) + len(lengths)
    if total < seq_len + 1:
        with pytest.raises(data_lib.DataError):
            data_lib.make_dataset("tokens", str(path / "shards"), **kw)
        return
    try:
        single = data_lib.make_dataset("tokens", str(path / "all.npy"), **kw)
    except data_lib.DataError as e:
        with pytest.raises(data_lib.DataError, match=str(e).split(" has ")[-1][:20]):
            data_lib.make_dataset("tokens", str(path / "shards"), **kw)
        return
    sharded = data_lib.make_dataset("tokens", str(path / "shards"), **kw)
    for split in data_lib.SPLITS:
        assert (single.streams[split] is None) == (sharded.streams[split] is None)
        if single.streams[split] is None:
            continue
        assert len(single.streams[split]) == len(sharded.streams[split])
        assert single.streams[split].num_docs == sharded.streams[split].num_docs
        for step in (0, 1, 5):
            a, b = single.batch(step, split), sharded.batch(step, split, rows=(0, 4))
            for key in a:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{split} step {step} {key}")


def _mixture_corpus(tmp_path):
    """Shards of three sources (ids 0-49, 100-149, 200-249; 40 documents each) and a fourth of one document."""
    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "mix")
    tok = tok_lib.ByteTokenizer(256)
    entries = []
    for k, (name, lo) in enumerate([("web", 0), ("code", 100), ("math", 200)]):
        docs = [np.append(rng.integers(lo, lo + 50, int(rng.integers(5, 60))), 256) for _ in range(40)]
        for j in range(2):
            entries.append(shard_lib.write_shard(str(tmp_path / "mix"), f"{name}-{j:05d}", docs[j::2], "uint16")
                           | {"source": name})
    one = [np.append(np.full(30, 260), 256)]  # a source of one document: no eval tail
    entries.append(shard_lib.write_shard(str(tmp_path / "mix"), "one-00000", one, "uint16") | {"source": "one"})
    tok.copy_to(str(tmp_path / "mix" / "tokenizer"))
    with open(tmp_path / "mix" / shard_lib.MANIFEST, "w") as f:
        json.dump(prep._manifest(tok, "uint16", [("web", "-"), ("code", "-"), ("math", "-"), ("one", "-")],
                                 entries), f)


def test_mixture_shares_follow_the_weights_and_per_source_rows_stay_in_their_source(tmp_path):
    _mixture_corpus(tmp_path)
    weights = {"web": 0.6, "code": 0.3, "math": 0.1}
    for sampler in ("random", "epoch"):
        ds = data_lib.make_dataset("tokens", str(tmp_path / "mix"), seq_len=8, global_batch_size=100, seed=1,
                                   vocab_size=300, sampler=sampler, mixture="web=6,code=3,math=1")
        sources = [s for step in range(100) for s in ds.row_sources(step)]
        for name, w in weights.items():
            assert abs(sources.count(name) / len(sources) - w) < 0.02, (sampler, name, sources.count(name))
        batch, rows = ds.batch(7), ds.row_sources(7)
        for row, name in zip(batch["inputs"], rows):  # each row's tokens come from its source's id range
            lo = {"web": 0, "code": 100, "math": 200}[name]
            assert np.all((row == 256) | ((row >= lo) & (row < lo + 50))), (name, row)
        assert ds.batch(7, rows=(10, 20))["inputs"].tolist() == batch["inputs"][10:20].tolist()
        ev = ds.batch(0, "eval", source="math")["inputs"]
        assert np.all((ev == 256) | ((ev >= 200) & (ev < 250)) | (ev == 0))
        assert ds.mixture_sources == ("web", "code", "math")
        # The last source has no eval tail: eval rows come from the others (the epoch sampler once gave it one).
        ds = data_lib.make_dataset("tokens", str(tmp_path / "mix"), seq_len=8, global_batch_size=100, seed=1,
                                   vocab_size=300, sampler=sampler, mixture="web=1,code=2,one=3")
        assert ds.streams["eval"].streams[2] is None and ds.mixture_sources == ("web", "code")
        assert set(ds.row_sources(0, "eval")) == {"web", "code"} and "one" in ds.row_sources(0)
        assert ds.batch(0, "eval")["inputs"].shape == (100, 8)


def test_the_epoch_sampler_deals_exact_shares_and_reads_each_sources_windows_once_per_epoch(tmp_path):
    """Epoch sampler over a mixture, against counts by hand: of rows 0..g (over steps), source k has taken
    its weight's share to within one row (the random sampler drifts by more), and the windows a source reads
    are a permutation of its windows, epoch after epoch (no window twice before all were read). Weights
    given unnormalised (2:1:1)."""
    _mixture_corpus(tmp_path)
    kw = dict(seq_len=32, global_batch_size=16, seed=3, vocab_size=300, mixture="web=2,code=1,math=1")
    ds = data_lib.make_dataset("tokens", str(tmp_path / "mix"), sampler="epoch", **kw)
    mixture, share = ds.streams["train"], {"web": 0.5, "code": 0.25, "math": 0.25}
    assert dict(zip(mixture.names, mixture.weights)) == share  # normalised as written
    zero = data_lib.make_dataset("tokens", str(tmp_path / "mix"), sampler="epoch", **{**kw, "mixture": "web=2,code=1,math=0"})
    assert zero.streams["train"].names == ("web", "code") and zero.streams["train"].weights == (2 / 3, 1 / 3)
    assert "math" not in zero.mixture_sources  # a source of weight 0 is not drawn, nor evaluated
    rows = [ds._mixture_row(mixture, step, "train", r) for step in range(60) for r in range(16)]
    counts = dict.fromkeys(share, 0)
    for g, (k, _) in enumerate(rows):
        counts[mixture.names[k]] += 1
        for name, w in share.items():
            assert abs(counts[name] - (g + 1) * w) <= 1, (g, counts)
    for k, name in enumerate(mixture.names):
        n_windows = data_lib._num_windows(len(mixture.streams[k]), 32)
        starts = [start for j, start in rows if j == k]
        assert len(starts) >= 2 * n_windows, (name, len(starts), n_windows)
        for e in range(2):  # two whole epochs of this source
            epoch = starts[e * n_windows:(e + 1) * n_windows]
            assert sorted(epoch) == [32 * i for i in range(n_windows)], (name, e)
        assert starts[:n_windows] != starts[n_windows:2 * n_windows]  # each epoch in its own order
    drawn = data_lib.make_dataset("tokens", str(tmp_path / "mix"), sampler="random", **kw)
    sources = [s for step in range(60) for s in drawn.row_sources(step)]
    drift = max(abs(sources[:g + 1].count(n) - (g + 1) * w) for g in range(len(sources)) for n, w in share.items())
    assert drift > 1, drift  # the random sampler is not the epoch sampler
    assert abs(sources.count("web") / len(sources) - 0.5) < 0.05  # but draws by the normalised weights
    # a source without documents in a split (None): the others share the draws by their weights' ratio
    web = mixture.names.index("web")
    no_web = dataclasses.replace(mixture, streams=tuple(None if k == web else s for k, s in enumerate(mixture.streams)))
    picked = [mixture.names[drawn._mixture_row(no_web, step, "train", r)[0]] for step in range(60) for r in range(16)]
    assert "web" not in picked and abs(picked.count("code") / len(picked) - 0.5) < 0.05, picked.count("code")
    # two sources of the same stream read its windows in orders of their own (the source is in the draw)
    twins = dataclasses.replace(mixture, names=("a", "b"), weights=(0.5, 0.5), streams=(mixture.streams[web],) * 2)
    n_windows = data_lib._num_windows(len(mixture.streams[web]), 32)
    dealt = [ds._mixture_row(twins, step, "train", r) for step in range(2 * n_windows // 16 + 1) for r in range(16)]
    orders = [[start for k, start in dealt if k == j][:n_windows] for j in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]
    only_one = data_lib.make_dataset("tokens", str(tmp_path / "mix"), sampler="epoch",
                                     **{**kw, "seq_len": 8, "mixture": "one=1"})  # one document: no eval tail
    with pytest.raises(data_lib.DataError, match=r"^no source of this mixture has documents in the 'eval' split; "
                                                 r"raise eval_fraction$"):
        only_one.batch(0, "eval")


def test_bad_corpora_and_mixtures_are_one_line_errors_before_anything_is_written(corpus, tmp_path):
    bpe = str(corpus["root"] / "bpe")
    out = str(tmp_path / "out")

    def refused(match, *args, **kw):
        with pytest.raises(ConfigError, match=match) as e:
            prep.prepare(*args, progress=False, log=lambda *_: None, **kw)
        assert "\n" not in str(e.value) and not os.path.exists(out), str(e.value)

    refused(r"--inputs web=/nonexistent/\*.jsonl: matches no files", ["web=/nonexistent/*.jsonl"], out, bpe)
    (tmp_path / "empty.txt").write_text("")
    refused(r"every file it matches is empty", [f"e={tmp_path}/empty.txt"], out, bpe)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    refused(r"bad.jsonl:1: no 'text' field \(it has: body\); fix the line, or pass --text_field=NAME",
            [f"{tmp_path}/bad.jsonl"], out, bpe)
    refused(r"--tokenizer='/no/tok.json': no such file", [f"{tmp_path}/bad.jsonl"], out, "/no/tok.json")

    good = str(tmp_path / "good")
    prep.prepare(corpus["inputs"][:2], good, bpe, shard_mb=0.004, progress=False, log=lambda *_: None)
    kw = dict(seq_len=16, global_batch_size=2, seed=0, vocab_size=512)
    with pytest.raises(data_lib.DataError, match="cannot read 'code=0.x'; write NAME=WEIGHT pairs"):
        data_lib.make_dataset("tokens", good, mixture="code=0.x", **kw)
    with pytest.raises(data_lib.DataError, match="mixture source 'web' is not in .* \\(its sources: code, docs\\)"):
        data_lib.make_dataset("tokens", good, mixture="web=1", **kw)
    with pytest.raises(data_lib.DataError, match="was tokenized by another tokenizer"):
        data_lib.make_dataset("tokens", good, tokenizer_hash=tok_lib.ByteTokenizer(256).hash, **kw)
    with pytest.raises(data_lib.DataError, match="holds id .*, outside vocab_size=300"):
        data_lib.make_dataset("tokens", good, **{**kw, "vocab_size": 300})
    # the messages whole: another tokenizer (each hash's first 12 digits), another eos, two directories whose
    # tokenizers differ (a copy whose manifest names another hash)
    with open(os.path.join(good, shard_lib.MANIFEST)) as f:
        written = json.load(f)
    ours, theirs = written["tokenizer"]["hash"], tok_lib.ByteTokenizer(256).hash
    with pytest.raises(data_lib.DataError) as e:
        data_lib.make_dataset("tokens", good, tokenizer_hash=theirs, **kw)
    assert str(e.value) == (f"shard directory {good!r} was tokenized by another tokenizer ({written['tokenizer']['kind']}, "
                            f"hash {ours[:12]}) than this run's (hash {theirs[:12]}); prepare it again with this "
                            f"tokenizer, or train with tokenizer={good}/tokenizer")
    eos = written["tokenizer"]["eos_id"]
    with pytest.raises(data_lib.DataError) as e:
        data_lib.make_dataset("tokens", good, eos_id=eos + 1, **kw)
    assert str(e.value) == (f"eos_id={eos + 1}, but shard directory {good!r} ends documents with {eos}; drop eos_id "
                            "(it comes from the tokenizer)")
    other = str(tmp_path / "other")
    shutil.copytree(good, other)
    with open(os.path.join(other, shard_lib.MANIFEST), "w") as f:
        json.dump({**written, "tokenizer": {**written["tokenizer"], "hash": theirs}}, f)
    data_lib.make_dataset("tokens", f"{good},{good}", **kw)  # one tokenizer twice: fine
    with pytest.raises(data_lib.DataError) as e:
        data_lib.make_dataset("tokens", f"{good},{other}", **kw)
    assert str(e.value) == (f"the shard directories {sorted([good, other])} were tokenized by different tokenizers; "
                            "prepare them with one tokenizer")
    manifest = shard_lib.read_manifest(good)
    first = os.path.join(good, shard_lib.token_file(manifest["shards"][0]["name"], "uint16"))
    # Bytes changed in place (the size the manifest says): the directory opens (a stat per shard), and the
    # first read of a window holding a changed id names the file and the token.
    shards = [shard_lib.Shard(good, e, manifest["dtype"]) for e in manifest["shards"]]
    whole = shard_lib.ShardStream(shards)
    clean, _ = whole.window(0, len(whole))
    np.testing.assert_array_equal(clean, np.concatenate([np.fromfile(s.path, "<u2") for s in shards]))
    with open(first, "r+b") as f:
        f.seek(2 * 5)
        f.write(np.array([manifest["shards"][0]["highest"] + 1], "<u2").tobytes())
    data_lib.make_dataset("tokens", good, **kw)
    fresh = shard_lib.ShardStream([shard_lib.Shard(good, e, manifest["dtype"]) for e in manifest["shards"]])
    fresh.window(6, 100)  # the windows without it read
    with pytest.raises(ConfigError, match=f"shard '{re.escape(first)}' holds id .* at token 5, outside the ids"):
        fresh.window(0, 100)
    with open(first, "r+b") as f:
        f.truncate(10)
    with pytest.raises(data_lib.DataError, match="holds 10 bytes, but the manifest says .* truncated"):
        data_lib.make_dataset("tokens", good, **kw)
    os.remove(first)
    with pytest.raises(data_lib.DataError, match="is missing or unreadable"):
        data_lib.make_dataset("tokens", good, **kw)


def test_tokenizers_of_every_kind_load_encode_decode_and_keep_their_hash_when_copied(corpus, tmp_path):
    text = "def f(x):\n    return 'é' + x  # 日本"
    bpe = tok_lib.load(str(corpus["root"] / "bpe" / "tokenizer.json"))
    assert bpe.decode(bpe.encode(text)) == text and bpe.eos_id == 0 and not bpe.add_bos
    loaded = [bpe, tok_lib.ByteTokenizer(256)]
    spm = pytest.importorskip("sentencepiece")
    with open(tmp_path / "train.txt", "w") as f:
        f.write("\n".join(open(p).read() for p in corpus["code"]))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=200, minloglevel=2)
    sp = tok_lib.load(str(tmp_path / "sp.model"))
    assert sp.kind == "sentencepiece" and sp.add_bos and sp.prompt("alpha")[0] == sp.bos_id
    assert sp.decode(sp.encode("alpha beta")) == "alpha beta"
    assert sp.decode(sp.encode("alpha") + [sp.vocab_size, sp.vocab_size + 3]) == "alpha"  # a padded vocabulary's ids
    assert sp.decode([0]) == sp.sp.decode([0]) != "" and sp.source == str(tmp_path / "sp.model")  # id 0: unk, kept
    assert (sp.bos_id, sp.eos_id) == (sp.sp.bos_id(), sp.sp.eos_id()) == (1, 2)  # the model's own ids
    # ids the model numbers from 0, and a model without an eos
    spm.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "sp0"),
                                   vocab_size=200, minloglevel=2, bos_id=0, unk_id=1, eos_id=-1)
    sp0 = tok_lib.load(str(tmp_path / "sp0.model"))
    assert (sp0.bos_id, sp0.eos_id, sp0.prompt("alpha")[0]) == (0, None, 0)
    (tmp_path / "junk.model").write_bytes(b"not a sentencepiece model" * 10)
    with pytest.raises(ConfigError, match=r"config.data.tokenizer='.*junk.model': not a readable SentencePiece model "
                                          r"\(\S") as e:
        tok_lib.SentencePieceTokenizer(str(tmp_path / "junk.model"))
    assert "\n" not in str(e.value)
    pytest.importorskip("tiktoken")
    import base64

    ranks = [bytes([i]) for i in range(256)] + [b"al", b"pha", b"alpha"]
    (tmp_path / "t.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tk = tok_lib.load(str(tmp_path / "t.tiktoken"))
    assert tk.encode("alpha") == [258] and tk.decode(tk.encode(text)) == text
    assert (tk.bos_id, tk.eos_id, tk.vocab_size) == (259, 260, 259 + tok_lib.TIKTOKEN_SPECIALS)
    # Llama 3's special tokens, numbered after the ranks, as its tokenizer.model (same format) has them
    last = f"<|reserved_special_token_{tok_lib.TIKTOKEN_SPECIALS - 3}|>"
    for name, want in (("<|begin_of_text|>", 259), ("<|end_of_text|>", 260), (last, tk.vocab_size - 1)):
        assert tk.enc.encode(name, allowed_special="all") == [want], name
    # a rendered chat: its control tokens as their ids, each id's [start, end) in the text, by hand
    pieces = [("<|begin_of_text|>", 259), ("alpha", 258), (" ", 32), ("al", 256), ("<|end_of_text|>", 260)]
    ends = np.cumsum([len(p) for p, _ in pieces]).tolist()
    assert tk.encode_chat("".join(p for p, _ in pieces)) == ([i for _, i in pieces],
                                                             list(zip([0] + ends[:-1], ends)))
    assert tk.files[0][0] == "tokenizer.tiktoken" and tk.source == str(tmp_path / "t.tiktoken")
    shutil.copyfile(tmp_path / "t.tiktoken", tmp_path / "llama3.model")
    assert tok_lib.TiktokenTokenizer(str(tmp_path / "llama3.model")).files[0][0] == "tokenizer.model"
    (tmp_path / "bad.tiktoken").write_text("YQ== 0\n\nYg== 1\nnot-a-line\n")
    with pytest.raises(ConfigError, match=r"bad.tiktoken':4: not a tiktoken BPE line \(base64 token, space, rank\)"):
        tok_lib.TiktokenTokenizer(str(tmp_path / "bad.tiktoken"))
    for i, tok in enumerate(loaded + [sp, tk]):
        copy = str(tmp_path / f"copy{i}")
        assert tok_lib.read_meta(copy) is None and not tok_lib.has_files(copy)  # nothing there yet
        tok.copy_to(copy)
        again = tok_lib.load(copy)
        assert (again.kind, again.hash, again.eos_id, again.encode(text)) == (tok.kind, tok.hash, tok.eos_id,
                                                                             tok.encode(text))
        meta = tok_lib.read_meta(copy)
        assert meta == json.loads(json.dumps(tok.meta())) and meta["hash"] == tok.hash
        # a directory `load` reads as a model's tokenizer: the file kinds of HF, SentencePiece, tiktoken
        assert tok_lib.has_files(copy) == (tok.kind != "bytes"), (tok.kind, os.listdir(copy))
        # a stored document: [bos] (where the tokenizer adds one) + the text's ids + [eos]
        ids = tok.encode("alpha beta")
        head = [tok.bos_id] if tok.add_bos else []
        assert tok.document("alpha beta") == head + ids + [tok.eos_id] and tok.prompt("alpha beta") == head + ids
    assert len({t.hash for t in loaded + [sp, tk]}) == 4


def test_a_committed_shard_reads_back_as_its_manifest_entry_and_a_misfit_index_is_refused(tmp_path):
    """`shard_entry` (what a restarted preparation reads back): the entry `write_shard` returned; an index
    that does not fit its tokens, each way it can fail alone, is a one-line ShardError with the fix."""
    d = str(tmp_path)
    docs = [[5, 9, 2], [7, 2], [11, 3, 3, 2]]  # eos 2 ends each document
    written = shard_lib.write_shard(d, "s", docs, "uint16")
    assert shard_lib.shard_entry(d, "s", "uint16", eos_id=2) == written
    assert (written["lowest"], written["highest"], written["tokens"], written["documents"]) == (2, 11, 9, 3)
    assert shard_lib.write_shard(d, "empty", [], "uint16") == shard_lib.shard_entry(d, "empty", "uint16", 2)
    assert shard_lib.shard_entry(d, "empty", "uint16", 2)["lowest"] == 0 == shard_lib.shard_entry(
        d, "empty", "uint16", 2)["highest"]
    index = os.path.join(d, shard_lib.docs_file("s"))
    for starts, eos in (([1, 3, 5], 2), ([0, 3, 9], 2), ([0, 3, 10], 2), ([0, 3, 5], 7)):
        np.save(index, np.asarray(starts, np.int64))  # the name ends in .npy: written as named
        with pytest.raises(ConfigError, match=r"shard 's' in .* is damaged \(its index does not fit its tokens\); "
                                              r"delete its files and rerun to write it again") as e:
            shard_lib.shard_entry(d, "s", "uint16", eos_id=eos)
        assert "\n" not in str(e.value)


def test_a_shard_damaged_in_place_stops_training_before_its_batch_reaches_the_model(tmp_path):
    """A shard whose bytes changed after it was written (same size: every stat agrees with the manifest)
    trained on: the read of the first batch refuses it with one line naming the file (a ConfigError: exit
    status 2 from launch/train.py), before step 1 runs or logs."""
    from parallax.train import train_and_evaluate

    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": f"note {i}: " + "abc" * 20}) + "\n"
                                                  for i in range(80)))
    prep.prepare([f"{tmp_path}/notes.jsonl"], str(tmp_path / "shards"), "bytes", progress=False, log=lambda *_: None)
    manifest = shard_lib.read_manifest(str(tmp_path / "shards"))
    assert len(manifest["shards"]) == 1
    path = os.path.join(tmp_path, "shards", shard_lib.token_file(manifest["shards"][0]["name"], manifest["dtype"]))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(np.full(size // 2, 65_533, "<u2").tobytes())  # ids past any 4,096 vocabulary, every one
    assert os.path.getsize(path) == size
    config = tiny_config()
    config.model.vocab_size = 384
    config.data.update(source="tokens", path=str(tmp_path / "shards"))
    config.train.update(steps=2, eval_every=0, checkpoint_every=0)
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(config, str(tmp_path / "run"), jax.devices()[:1], log=lambda *_: None)
    assert "\n" not in str(e.value) and path in str(e.value) and "holds id 65533" in str(e.value), str(e.value)
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_bpe_to_shards_to_a_pipelined_run_that_resumes_and_samples_text(tmp_path):
    """Acceptance: a BPE of 4,096 ids trained on stdlib sources, shards from .py files and a .jsonl, 100 steps on
    a pipe 2 x data 2 mesh with a mixture, a resume, per-source eval losses, and a sample decoded as text."""
    from parallax.sample import sample_from_workdir
    from parallax.train import train_and_evaluate

    records = [{"text": f"Record {i}: the value of x is {i * 7 % 13}."} for i in range(600)]
    with open(tmp_path / "notes.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    inputs = [f"code={STDLIB}/json/*.py", f"code={STDLIB}/email/*.py", f"notes={tmp_path}/notes.jsonl"]
    r = run_launcher("train_tokenizer", *[f"--inputs={i}" for i in inputs], "--vocab_size=4096",
                     f"--output={tmp_path}/bpe", timeout=300)
    assert r.returncode == 0 and "4096 ids" in r.stdout, r.stderr
    r = run_launcher("prepare_data", *[f"--inputs={i}" for i in inputs], f"--tokenizer={tmp_path}/bpe",
                     f"--output={tmp_path}/shards", "--shard_mb=0.1", "--noprogress", timeout=300)
    assert r.returncode == 0 and "shards (" in r.stdout, r.stderr

    config = tiny_config(pipe=2, data=2)
    config.model.vocab_size = 0  # from the tokenizer
    config.data.update(source="tokens", path=f"{tmp_path}/shards", mixture="code=0.7,notes=0.3")
    config.train.update(steps=60, checkpoint_every=30, eval_every=50, log_every=10, global_batch_size=8)
    config.optim.update(decay_steps=100, lr=3e-3)
    work = str(tmp_path / "run")
    devices = jax.devices()[:4]
    first = train_and_evaluate(config, work, devices, log=lambda *_: None)
    assert first.trainer.config.model.vocab_size == 4096 and first.trainer.config.data.eos_id == 0
    config.train.steps = 100
    logs = []
    train_and_evaluate(config, work, devices, log=logs.append)
    assert any("resumed from" in line for line in logs)
    metrics = read_metrics(work)
    assert [m["step"] for m in metrics][-1] == 100 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert {"eval_loss", "eval_loss/code", "eval_loss/notes"} <= set(metrics[-1])
    assert tok_lib.read_meta(os.path.join(work, "tokenizer"))["hash"] == tok_lib.load(f"{tmp_path}/bpe").hash
    sample = sample_from_workdir(work, "Record 1", num_tokens=20, temperature=0)
    assert sample.startswith("step 100 sample:\nRecord 1") and "token ids" not in sample, sample

    # The corpus prepared again in place with another tokenizer: resuming on it is refused.
    prep.prepare(inputs, f"{tmp_path}/shards", "bytes", overwrite=True, progress=False, log=lambda *_: None)
    config.model.vocab_size = 4096
    with pytest.raises(ConfigError, match="not the tokenizer this run was trained with"):
        train_and_evaluate(config, work, devices, log=lambda *_: None)


def test_the_tokenizer_sets_eos_and_vocab_and_a_disagreeing_config_is_a_one_line_error(corpus, tmp_path):
    from parallax.train import resolve_data

    bpe = str(corpus["root"] / "bpe")
    config = tiny_config(tensor=2)
    config.data.update(source="tokens", path=str(tmp_path / "x.npy"), tokenizer=bpe)
    config.model.vocab_size = 0
    resolved, tok = resolve_data(config)
    assert (resolved.model.vocab_size, resolved.data.eos_id, tok.vocab_size) == (512, 0, 512)
    assert config.model.vocab_size == 0  # a copy: the caller's config is left as it was
    config.model.vocab_size = 500
    with pytest.raises(ConfigError, match=r"config.model.vocab_size=500: the tokenizer .* emits ids up to 511; set "
                                          r"model.vocab_size=512 \(or 0: from the tokenizer\)"):
        resolve_data(config)
    config.model.vocab_size, config.data.eos_id = 512, 3
    with pytest.raises(ConfigError, match="config.data.eos_id=3: the tokenizer's eos is 0"):
        resolve_data(config)
    config.data.update(source="text", eos_id=-1)
    with pytest.raises(ConfigError, match=r"source='text' trains on bytes; .* \(launch/prepare_data.py"):
        resolve_data(config)
    config.data.source = "synthetic"
    with pytest.raises(ConfigError, match="source='synthetic' makes token ids"):
        resolve_data(config)
    r = run_launcher("prepare_data", "--inputs=/nonexistent/*.txt", f"--output={tmp_path}/o", timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "config error: --inputs main=/nonexistent/*.txt: matches no files; fix the pattern (globs need quotes, ** "
        "for subdirectories)"], r.stderr


def test_a_trained_bpe_loads_in_transformers_and_bytes_decode_as_utf8_does(tmp_path):
    """train_bpe's smallest vocabulary (256 bytes + eos), retrained into the same directory; transformers
    reads its tokenizer_config.json (eos, no bos, no length bound); the byte tokenizer decodes as Python's
    UTF-8 decoder with replacement, leaving out ids past the bytes (eos); what `load` takes for a
    SentencePiece model versus a tiktoken file."""
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=r"--vocab_size=256: a byte-level BPE needs at least 257 ids"):
        tok_lib.train_bpe(["abc"], 256, str(tmp_path / "small"), show_progress=False)
    texts = ["the cat sat on the mat", "def f(x): return x"] * 5
    for _ in range(2):  # a second run into the same directory overwrites it
        bpe = tok_lib.train_bpe(texts, 257, str(tmp_path / "bpe"), show_progress=False)
    assert bpe.vocab_size == 257 and bpe.eos_id == 0 and bpe.decode(bpe.encode("the cat")) == "the cat"
    bpe = tok_lib.train_bpe(texts, 270, str(tmp_path / "bpe"), show_progress=False)  # the corpus has 280 in it
    assert bpe.vocab_size == 270
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    assert hf.is_fast and hf.eos_token == "<|endoftext|>" and hf.bos_token is None
    assert hf.model_max_length >= 1 << 30 and hf.encode("the cat", add_special_tokens=False) == bpe.encode("the cat")
    raw = [0, 104, 105, 256, 255, 195]  # a NUL, "hi", an eos id, a stray byte, half a 2-byte character
    assert tok_lib.ByteTokenizer(256).decode(raw) == bytes([0, 104, 105, 255, 195]).decode("utf-8", "replace")
    (tmp_path / "a.tiktoken").write_bytes(b"YWI= 0\nYw== 1\n")
    (tmp_path / "b.model").write_bytes(b"\x0a\x0b\x08\x01" + bytes(range(128, 250)))  # protobuf-like binary
    (tmp_path / "c.model").write_bytes(b"YWI= 0 extra\nYw== 1\n")  # not two fields: not tiktoken
    (tmp_path / "d.model").write_bytes(b"\nYWI= 0\n")  # an empty first line: not tiktoken
    assert [tok_lib._is_sentencepiece(str(tmp_path / n)) for n in ("a.tiktoken", "b.model", "c.model", "d.model")] \
        == [False, True, True, True]


def test_the_token_dtype_holds_every_id_of_the_vocabulary():
    for vocab, want in ((256, "uint16"), (1 << 16, "uint16"), ((1 << 16) + 1, "uint32"), (200_000, "uint32")):
        assert shard_lib.dtype_for(vocab) == want, vocab
        assert np.iinfo(shard_lib.DTYPES[want]).max >= vocab - 1  # the largest id fits


def test_inputs_name_sources_walk_directories_and_sample_a_byte_budget(tmp_path, monkeypatch):
    """parse_inputs / _files / iter_texts against the file system by hand: `NAME=GLOB` names a source unless
    a file of that literal name exists; a directory is walked in sorted order without hidden entries or
    __pycache__; `**` recurses; iter_texts stops at the first text that reaches max_bytes, reads text_field,
    and a missing pyarrow or a line that is not JSON is one line naming the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a=b.txt").write_text("literal")
    assert prep.parse_inputs(["web=x/*.txt", "a=b.txt", "plain/*.txt"]) == [
        ("web", "x/*.txt"), ("main", "a=b.txt"), ("main", "plain/*.txt")]
    with pytest.raises(ConfigError, match=r"^--inputs: none given; pass e\.g\. --inputs='web=data/\*\.jsonl' "):
        prep.parse_inputs([])
    for rel in ("d/b.txt", "d/a.txt", "d/sub/c.txt", "d/.hidden/x.txt", "d/__pycache__/y.txt", "d/.dot.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    assert prep._files("d") == ["d/a.txt", "d/b.txt", "d/sub/c.txt"]
    assert prep._files("d/**/*.txt") == ["d/__pycache__/y.txt", "d/a.txt", "d/b.txt", "d/sub/c.txt"]
    (tmp_path / "j.jsonl").write_text("".join(json.dumps({"body": "x" * n, "text": "-"}) + "\n" for n in (3, 4, 5)))
    assert list(prep.iter_texts(["j.jsonl"], "body")) == ["xxx", "xxxx", "xxxxx"]
    assert list(prep.iter_texts(["j.jsonl"], "body", max_bytes=7)) == ["xxx", "xxxx"]  # 3 + 4 reaches 7
    assert list(prep.iter_texts(["j.jsonl"], "body", max_bytes=8)) == ["xxx", "xxxx", "xxxxx"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": \n')
    with pytest.raises(ConfigError, match=r"^bad\.jsonl:3: not JSON \(.*\); each line must be one JSON object$"):
        prep.iter_texts(["bad.jsonl"])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [f"row {i} " * (i + 1) for i in range(5)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "small.parquet", row_group_size=2)  # groups 2, 2, 1
    assert list(prep.iter_texts(["small.parquet"])) == rows  # one unit up to the last group, which ends it
    units, _ = prep.plan_units([("pq", "small.parquet")], 1)  # a unit per row group
    assert [(u.start, u.stop) for u in units] == [(0, 1), (1, 2), (2, 3)]  # row groups
    assert [t for u in units for t in prep.read_unit(u)] == rows
    pq.write_table(pa.table({"body": rows}), tmp_path / "body.parquet")
    with pytest.raises(ConfigError) as e:
        prep.iter_texts(["body.parquet"])
    assert str(e.value) == "body.parquet: no 'text' column (it has: body); pass --text_field=NAME"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("not a preparation's")
    with pytest.raises(ConfigError) as e:
        prep.prepare(["small.parquet"], "full", progress=False, log=lambda *_: None)
    assert str(e.value) == ("--output=full: not empty and not a preparation's directory (no prepare.json); pass "
                            "a new or empty --output")
    assert os.listdir(tmp_path / "full") == ["mine.txt"]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": [f"document {i} " * 20 for i in range(60)]}).save_to_disk("ds")
    nbytes = sum(os.path.getsize(f) for f in prep._arrow_files("ds"))
    units, _ = prep.plan_units([("hf", "ds")], nbytes // 6)  # about a sixth of the rows per unit
    assert 5 <= len(units) <= 8 and sum(u.stop - u.start for u in units) == 60, [(u.start, u.stop) for u in units]
    assert [t for u in units for t in prep.read_unit(u)] == [f"document {i} " * 20 for i in range(60)]
    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name.startswith("pyarrow") else real_import(name, *a, **k))
    with pytest.raises(ConfigError, match=r"^t\.parquet: reading parquet / datasets files needs pyarrow; "
                                          r"pip install pyarrow \(or parallax\[data\]\)$"):
        prep._pyarrow("t.parquet")


def test_mixture_weights_parse_as_written_and_an_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """parse_mixture by hand: fractional and zero weights are read as written, a weight without a name or
    a negative one is refused; a shard whose highest id is vocab_size (one past the last id) is refused and
    one whose highest is vocab_size - 1 is not."""
    assert data_lib.parse_mixture("web=0.7, code=0.25,math=0") == {"web": 0.7, "code": 0.25, "math": 0.0}
    for bad in ("=0.5", "web=-1", "web=0.5,web=0.5", "web"):
        with pytest.raises(data_lib.DataError, match=r"^mixture=.*: cannot read .*; write NAME=WEIGHT pairs"):
            data_lib.parse_mixture(bad)
    with pytest.raises(data_lib.DataError) as e:  # the value is what follows the first '='
        data_lib.parse_mixture("web=1=2")
    assert str(e.value) == ("mixture='web=1=2': cannot read 'web=1=2'; write NAME=WEIGHT pairs with distinct names "
                            "and weights >= 0, e.g. mixture='web=0.7,code=0.3'")
    with pytest.raises(data_lib.DataError) as e:
        data_lib.parse_mixture("web=0,code=0")
    assert str(e.value) == ("mixture='web=0,code=0': the weights sum to 0; give at least one source a positive "
                            "weight")
    tok = tok_lib.ByteTokenizer(256)
    for highest, ok in ((299, True), (300, False)):
        out = tmp_path / f"h{highest}"
        out.mkdir()
        entry = shard_lib.write_shard(str(out), "main-00000", [np.array([1, 2, highest, 256] * 20)], "uint16")
        tok.copy_to(str(out / "tokenizer"))
        with open(out / shard_lib.MANIFEST, "w") as f:
            json.dump(prep._manifest(tok, "uint16", [("main", "-")], [entry | {"source": "main"}]), f)
        make = lambda: data_lib.make_dataset("tokens", str(out), seq_len=8, global_batch_size=2, seed=0,  # noqa: E731
                                             vocab_size=300)
        if ok:
            assert make().batch(0)["inputs"].shape == (2, 8)
        else:
            with pytest.raises(data_lib.DataError, match=r"holds id 300, outside vocab_size=300; raise "):
                make()


def test_an_hf_directorys_bos_and_eos_follow_its_config_else_its_post_processor_and_vocabulary(tmp_path):
    """bos: documents start with it where tokenizer_config.json says add_bos_token, or, where it does not
    say, where the tokenizer's own post-processor adds it (Llama 3's way; transformers' tokenizer of the same
    directory is the reference); eos: the config's eos_token, else the first usual end token the vocabulary
    holds (`<|endoftext|>` before `</s>`)."""
    import transformers
    from tokenizers import processors

    from helpers import byte_level_bpe

    for name, post, config, add_bos in (("post", True, {"bos_token": "<s>"}, True),
                                        ("plain", False, {"bos_token": "<s>"}, False),
                                        ("said_no", True, {"bos_token": "<s>", "add_bos_token": False}, False),
                                        ("said_yes", False, {"bos_token": "<s>", "add_bos_token": True}, True),
                                        ("eos_named", False, {"eos_token": "</s>"}, False)):
        rust = byte_level_bpe(["hello world, a test"] * 10, 300, ["<s>", "</s>", "<|endoftext|>"])
        bos = rust.token_to_id("<s>")
        if post:
            rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
        directory = tmp_path / name
        directory.mkdir()
        rust.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        tok = tok_lib.load(str(directory))
        assert tok.add_bos == add_bos and (tok.documents(["a"])[0][0] == bos) == add_bos, name
        assert tok.describe().endswith(f", bos {bos if add_bos else None})"), name  # the bos documents get
        assert tok.bos_id == (bos if "bos_token" in config else None), name
        if name in ("post", "plain"):
            fast = transformers.AutoTokenizer.from_pretrained(str(directory))
            assert (fast("a")["input_ids"][0] == bos) == add_bos, name
        eos = "</s>" if name == "eos_named" else "<|endoftext|>"
        assert tok.eos_id == rust.token_to_id(eos) and tok.documents(["a"])[0][-1] == tok.eos_id, name


def test_tokenizer_specs_load_what_they_name_and_refuse_the_rest_word_for_word(tmp_path):
    """`load` by hand: '' and 'bytes' are the byte tokenizer (with the eos asked for); an HF directory's
    tokenizer_config.json may hold a list of named chat templates (the 'default' one is the template); the
    refusals whole, under the default key and under the key a command names (prepare_data's --tokenizer);
    what a tokenizer records (`meta`) and how it describes itself."""
    from helpers import byte_level_bpe

    for spec in ("", "bytes"):
        tok = tok_lib.load(spec, eos_id=3)
        assert (tok.kind, tok.eos_id, tok.vocab_size) == ("bytes", 3, 256), spec
    assert tok.meta() == {"kind": "bytes", "hash": tok.hash, "vocab_size": 256, "eos_id": 3, "bos_id": None,
                          "add_bos": False, "files": []}
    assert tok.describe() == "bytes tokenizer bytes (256 ids, eos 3, bos None)"
    hf = tmp_path / "hf"
    hf.mkdir()
    byte_level_bpe(["hello world"] * 10, 280, ["<s>", "</s>"]).save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "add_bos_token": True, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    tok = tok_lib.load(str(hf))
    assert tok.kind == "hf" and tok.chat_template == "D" and tok.source == str(hf)
    assert tok.meta()["files"] == ["tokenizer.json", "tokenizer_config.json"]
    assert tok.describe() == f"hf tokenizer {hf} ({tok.vocab_size} ids, eos 1, bos 0)"
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for spec, rest in (
            ("/no/such", "no such file or directory; pass 'bytes', a tokenizer.json, an HF model directory, or a "
                         "SentencePiece / tiktoken model file"),
            (str(tmp_path / "empty"), "the directory holds no tokenizer.json, tokenizer.model or tokenizer.tiktoken; "
                                      "pass the directory of an HF model or a file"),
            (str(tmp_path / "notes.txt"), "unknown kind of file; pass a tokenizer.json, an HF model directory, a "
                                          "SentencePiece .model or a tiktoken .tiktoken / tokenizer.model")):
        for key in (None, "config.data.tokenizer", "--tokenizer"):  # None: the default key
            with pytest.raises(ConfigError) as e:
                tok_lib.load(spec) if key is None else tok_lib.load(spec, key=key)
            assert str(e.value) == f"{key or 'config.data.tokenizer'}={spec!r}: {rest}", (spec, key)


def test_tokenizer_files_read_as_their_own_libraries_read_them_and_refusals_quote_the_library(tmp_path, monkeypatch):
    """What `load` reads from each kind of file, against the file's own library: an HF vocabulary counts the
    tokens added after training; a config token may be {"content": ...} (older transformers write that); a
    tokenizer.json under another name is read alone (not with the directory's tokenizer_config.json), and
    without a usual end token it has no eos; text and chat text encode without the post-processor's bos and
    decoding drops special tokens; a SentencePiece model numbering its eos 0 and without bos; a tiktoken
    file's 256 special tokens, its bos, and the names a chat template reads; the byte tokenizer's chat
    offsets; the refusals whole: an unreadable tokenizer.json or SentencePiece model (the library's first
    error line, cut at 120 characters), a missing optional package."""
    import base64

    import tokenizers
    from tokenizers import processors

    from helpers import byte_level_bpe

    rust = byte_level_bpe(["hello world, a test"] * 10, 300, ["<s>", "</s>"])
    bos, eos = rust.token_to_id("<s>"), rust.token_to_id("</s>")
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    rust.add_special_tokens(["<|im_end|>"])  # added after training: outside the model's own vocabulary
    d = tmp_path / "hf"
    d.mkdir()
    rust.save(str(d / "tokenizer.json"))
    shutil.copyfile(d / "tokenizer.json", d / "other.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>", "lstrip": False},
                                                         "eos_token": {"content": "</s>", "rstrip": False}}))
    tok = tok_lib.load(str(d))
    assert tok.vocab_size == rust.get_vocab_size(with_added_tokens=True) == rust.token_to_id("<|im_end|>") + 1
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (bos, eos, True)
    assert tok.template_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert tok.encode("hello") == rust.encode("hello", add_special_tokens=False).ids != rust.encode("hello").ids
    assert tok.decode(tok.document("hello")) == "hello"  # bos and eos dropped
    assert tok.encode_chat("<s>hello</s>")[0] == [bos] + tok.encode("hello") + [eos]  # the text's own bos only
    alone = tok_lib.load(str(d / "other.json"))  # no config read: eos the first usual end token it holds
    assert (alone.eos_id, alone.bos_id, alone.add_bos, alone.template_tokens) == (eos, None, False, {})
    assert alone.files == [("tokenizer.json", str(d / "other.json"))]
    rust_no_end = byte_level_bpe(["hello world"] * 10, 280, ["<pad>"])
    rust_no_end.save(str(tmp_path / "no_end.json"))
    no_end = tok_lib.load(str(tmp_path / "no_end.json"))
    assert no_end.eos_id is None and no_end.document("hello") == no_end.encode("hello")  # nothing to end it
    # an unreadable tokenizer.json: the library's first error line, cut at 120 characters
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text(json.dumps({"added_tokens": "Z" * 150}))
    with pytest.raises(Exception) as lib:
        tokenizers.Tokenizer.from_file(str(tmp_path / "bad" / "tokenizer.json"))
    first = str(lib.value).splitlines()[0]
    assert len(first) > 121
    with pytest.raises(ConfigError) as e:
        tok_lib.load(str(tmp_path / "bad"))
    assert str(e.value) == (f"config.data.tokenizer={str(tmp_path / 'bad')!r}: {tmp_path / 'bad' / 'tokenizer.json'} "
                            f"is not a readable tokenizer.json ({first[:120]}); pass a file written by the "
                            "tokenizers or transformers library")
    # the byte tokenizer: a template's tokens are text, each byte's offsets those of its character
    assert tok_lib.ByteTokenizer().encode_chat("aé<") == ([97, 0xC3, 0xA9, 60], [(0, 1), (1, 2), (1, 2), (2, 3)])
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "train.txt").write_text("\n".join(["alpha beta gamma delta", "the cat sat on the mat"] * 50))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"), model_prefix=str(tmp_path / "eos0"),
                                   vocab_size=20, minloglevel=2, eos_id=0, unk_id=1, bos_id=-1)
    sp = tok_lib.load(str(tmp_path / "eos0.model"))
    assert (sp.eos_id, sp.bos_id, sp.add_bos) == (0, None, False) and sp.document("alpha")[-1] == 0
    with pytest.raises(ConfigError) as e:
        sp.encode_chat("<s>alpha")
    assert str(e.value) == ("a sentencepiece tokenizer cannot encode a chat template's special tokens; use the "
                            "model's Hugging Face tokenizer (a tokenizer.json, or its directory)")
    long = tmp_path / ("j" * 130 + ".model")  # SentencePiece names the file in its error: longer than the cut
    long.write_bytes(b"\xff\xfe not ascii, not a protobuf" * 4)  # a first line that is not ASCII: not tiktoken
    with pytest.raises(Exception) as lib:
        spm.SentencePieceProcessor(model_file=str(long))
    first = str(lib.value).splitlines()[0]
    assert len(first) > 121
    with pytest.raises(ConfigError) as e:
        tok_lib.load(str(long))
    assert str(e.value) == f"config.data.tokenizer={str(long)!r}: not a readable SentencePiece model ({first[:120]})"
    pytest.importorskip("tiktoken")
    ranks = [bytes([i]) for i in range(256)] + [b"al", b"pha", b"alpha"]
    (tmp_path / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                      for r, t in enumerate(ranks)))
    tk = tok_lib.load(str(tmp_path / "tokenizer.model"))  # Llama 3's name, tiktoken's format
    assert tk.kind == "tiktoken" and tk.enc.name == "tokenizer.model" and tk.add_bos
    assert len(tk.enc.special_tokens_set) == tok_lib.TIKTOKEN_SPECIALS
    assert tk.template_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert tk.prompt("alpha") == [259, 258] and tk.decode(tk.document("alpha") + [tk.vocab_size - 1]) == "alpha"
    # a missing optional package: the file, the package and how to install it
    for package, path in (("sentencepiece", tmp_path / "eos0.model"), ("tiktoken", tmp_path / "tokenizer.model")):
        monkeypatch.setitem(__import__("sys").modules, package, None)  # `import` of it raises ImportError
        with pytest.raises(ConfigError) as e:
            tok_lib.load(str(path))
        assert str(e.value) == (f"config.data.tokenizer={str(path)!r} needs the {package} package; pip install "
                                f"{package} (or parallax[data])")


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=10), moves=st.lists(st.integers(0, 2), max_size=10),
       masked=st.lists(st.booleans(), min_size=21, max_size=21), data=st.data())
def test_a_stream_of_shards_reads_as_the_concatenation_of_its_documents_and_masks(tmp_path_factory, sizes, moves,
                                                                                  masked, data):
    """Shards with and without a loss mask, empty ones among them, a stream over any [lo, hi) of them, any
    window: the tokens, document starts, loss mask, document count and next document start equal numpy's
    reading of the concatenated documents (the mask all ones where a shard has none)."""
    path = str(tmp_path_factory.mktemp("stream"))
    rng = np.random.default_rng(len(sizes) * 31 + sum(moves))
    docs = [rng.integers(0, 300, n) for n in sizes]
    masks = [rng.integers(0, 2, n).astype(np.uint8) for n in sizes]
    shard_of = np.cumsum([0] + (moves + [0] * len(sizes))[: len(sizes) - 1]).tolist()  # a step of 2: an empty shard
    shards = []
    for k in range(shard_of[-1] + 1):
        mine = [i for i in range(len(docs)) if shard_of[i] == k]
        entry = shard_lib.write_shard(path, f"s{k}", [docs[i] for i in mine], "uint16",
                                      masks=[masks[i] for i in mine] if masked[k] else None)
        shards.append(shard_lib.Shard(path, entry, "uint16"))
    tokens = np.concatenate(docs)
    mask = np.concatenate([m if masked[shard_of[i]] else np.ones_like(m) for i, m in enumerate(masks)])
    starts = np.cumsum([0] + sizes[:-1])
    lo = data.draw(st.integers(0, len(tokens)))
    hi = data.draw(st.integers(lo, len(tokens)))
    stream = shard_lib.ShardStream(shards, lo, hi)
    assert len(stream) == hi - lo and stream.has_mask == any(masked[k] for k in range(len(shards)))
    assert stream.num_docs == int(((starts >= lo) & (starts < hi)).sum())
    for g in (lo, data.draw(st.integers(0, len(tokens) + 1))):
        later = starts[starts >= g]
        assert stream.first_start_at_or_after(g) == (int(later[0]) if len(later) else None), g
    offset = data.draw(st.integers(0, hi - lo))
    n = data.draw(st.integers(0, hi - lo - offset + 3))
    a, b = lo + offset, min(lo + offset + n, hi)
    got, got_starts = stream.window(offset, n)
    assert got.dtype.kind == "u" if b > a else got.dtype == np.int64  # ids, also where the window is empty
    assert got_starts.dtype == np.int64
    np.testing.assert_array_equal(got, tokens[a:b])
    np.testing.assert_array_equal(got_starts, np.concatenate([[0], starts[(starts > a) & (starts < b)] - a]))
    got_mask = stream.loss_mask(offset, n)
    assert got_mask.dtype == np.uint8
    np.testing.assert_array_equal(got_mask, mask[a:b])


def test_a_changed_byte_in_a_shard_or_its_mask_is_refused_naming_the_first_value_out_of_range(tmp_path):
    """Bytes changed after a shard was written (same size, so the stat check passes) are refused when a
    window reads them: an id below the manifest's lowest as well as above its highest, and a mask byte of 2,
    each at its own token (counted from the shard's start, not the window's), the message whole."""
    d = str(tmp_path)
    entry = shard_lib.write_shard(d, "s", [[5, 6, 7, 8, 9, 9, 5]], "uint16", masks=[[1, 0, 1, 1, 0, 1, 1]])
    shard = shard_lib.Shard(d, entry, "uint16")
    tokens = np.memmap(shard.path, dtype=np.uint16, mode="r+")
    tokens[3], tokens[5] = 3, 9  # an id below the lowest (5) in a window whose highest is still in range
    tokens.flush()
    del tokens
    np.testing.assert_array_equal(shard.read(0, 3), [5, 6, 7])
    with pytest.raises(shard_lib.ShardError) as e:
        shard.read(1, 6)
    assert str(e.value) == (f"shard {shard.path!r} holds id 3 at token 3, outside the ids [5, 9] its manifest "
                            "records: the file was changed after it was written; prepare the directory again with "
                            "launch/prepare_data.py")
    mask = np.memmap(shard.mask_path, dtype=np.uint8, mode="r+")
    mask[4] = 2  # after 1s: the first value above 1 is named, at its own token
    mask.flush()
    del mask
    np.testing.assert_array_equal(shard.read_mask(0, 4), [1, 0, 1, 1])
    with pytest.raises(shard_lib.ShardError) as e:
        shard.read_mask(2, 7)
    assert str(e.value) == (f"shard mask {shard.mask_path!r} holds 2 at token 4, not 0 or 1: the file was changed "
                            "after it was written; prepare the directory again")


def test_shard_files_that_disagree_are_refused_word_for_word_and_an_old_entry_reads_with_defaults(tmp_path):
    """corpus.py's refusals whole, each built alone: what `write_shard` will not write, what `shard_entry`
    (a restarted preparation) finds damaged, a document index that is not one (junk, int32, 2-D, pickled
    objects, cut short: numpy's first line), a directory that is not a shard directory, a manifest of
    another format, a missing or cut mask; a committed shard needs its mask only where it has one; an entry
    without the keys older manifests lacked reads as ids anywhere in its dtype, without a mask."""
    d = str(tmp_path)
    fix = "delete the shard's files and rerun to write it again"
    # write_shard: a mask of another length, or a value above 1, is refused (the documents stay unwritten)
    for masks in ([[1, 0]], [[1, 0, 2]]):
        with pytest.raises(ValueError) as e:
            shard_lib.write_shard(d, "w", [[5, 6, 7]], "uint16", masks=masks)
        assert str(e.value) == f"shard w: {len(masks[0])} mask values for 3 tokens (or not 0 / 1)"
    empty = shard_lib.write_shard(d, "empty", [], "uint16", masks=[])  # a shard of no documents
    assert (empty["tokens"], empty["documents"], empty["mask"]) == (0, 0, True)
    sizes = [os.path.getsize(os.path.join(d, name)) for name in ("empty.uint16.bin", "empty.mask.bin")]
    assert sizes == [0, 0]
    entry = shard_lib.write_shard(d, "s", [[5, 6, 2], [7, 2]], "uint16", masks=[[0, 1, 1], [1, 1]])  # lists: bytes
    assert os.path.getsize(os.path.join(d, "s.mask.bin")) == 5
    assert shard_lib.committed(d, "s", "uint16", masked=True) and shard_lib.committed(d, "s", "uint16")
    shutil.copyfile(os.path.join(d, "s.uint16.bin"), os.path.join(d, "m.uint16.bin"))
    shutil.copyfile(os.path.join(d, "s.docs.npy"), os.path.join(d, "m.docs.npy"))
    assert shard_lib.committed(d, "m", "uint16") and not shard_lib.committed(d, "m", "uint16", masked=True)
    # shard_entry: a mask that does not fit its tokens, each way alone
    mask_path = os.path.join(d, "s.mask.bin")
    for data in (b"\x01\x01\x01\x01", b"\x01\x01\x02\x01\x01"):
        with open(mask_path, "wb") as f:
            f.write(data)
        with pytest.raises(shard_lib.ShardError) as e:
            shard_lib.shard_entry(d, "s", "uint16", eos_id=2, masked=True)
        assert str(e.value) == (f"shard 's' in {d!r} is damaged (its mask does not fit its tokens); delete its files "
                                "and rerun to write it again")
    with open(mask_path, "wb") as f:
        f.write(b"\x00\x01\x01\x01\x01")
    # a document index that is not one: the reason, then the fix of the reader that found it
    index = os.path.join(d, "s.docs.npy")
    np.save(tmp_path / "objects.npy", np.array([0, "a", None], dtype=object))
    np.save(tmp_path / "short.npy", np.arange(3, dtype=np.int64))
    short = (tmp_path / "short.npy").read_bytes()[:-8]
    for content, reason in ((b"junk" * 4, "no .npy header"),
                            (np.int32([0, 3]), "holds int32[2], not a list of int64 offsets"),
                            (np.int64([[0, 3], [1, 2]]), "holds int64[2, 2], not a list of int64 offsets"),
                            ((tmp_path / "objects.npy").read_bytes(),
                             "Object arrays cannot be loaded when allow_pickle=False"),
                            (short, "Failed to read all data for array. Expected (3,) = 3 elements, could only read 2 "
                                    "elements. (file seems not fully written?)")):
        if isinstance(content, bytes):
            with open(index, "wb") as f:
                f.write(content)
        else:
            np.save(index, content)
        with pytest.raises(shard_lib.ShardError) as e:
            shard_lib.shard_entry(d, "s", "uint16", eos_id=2, masked=True)
        assert str(e.value) == f"shard index {index!r} is damaged ({reason}); {fix}", reason
    np.save(index, np.int64([0, 3]))
    assert shard_lib.shard_entry(d, "s", "uint16", eos_id=2, masked=True) == entry | {
        "mask_sha256": shard_lib.shard_entry(d, "s", "uint16", eos_id=2, masked=True)["mask_sha256"]}
    shard = shard_lib.Shard(d, entry, "uint16")
    assert isinstance(shard.starts, np.memmap)  # read lazily, as the tokens are
    # a shard's mask missing, or cut short
    os.rename(mask_path, mask_path + ".away")
    with pytest.raises(shard_lib.ShardError) as e:
        shard.check()
    assert str(e.value) == (f"shard {mask_path!r} is missing or unreadable; restore it, or prepare {d!r} again with "
                            "launch/prepare_data.py")
    with open(mask_path, "wb") as f:
        f.write(b"\x01\x01")
    with pytest.raises(shard_lib.ShardError) as e:
        shard.check()
    assert str(e.value) == (f"shard mask {mask_path!r} holds 2 bytes, but the manifest says 5 tokens; the file was "
                            "changed or truncated: prepare the directory again")
    # an entry as older manifests wrote it: no id range, no mask
    old = shard_lib.Shard(d, {"name": "s", "tokens": 5, "documents": 2}, "uint16")
    assert (old.lowest, old.highest, old.has_mask) == (0, 65535, False)
    # directories that are not shard directories, and a manifest of another format
    os.makedirs(tmp_path / "partial")
    os.makedirs(tmp_path / "other")
    shutil.copyfile(index, tmp_path / "partial" / "s.docs.npy")
    for path, want in ((str(tmp_path / "nothing"), "is not a directory; pass a directory that "
                                                   "launch/prepare_data.py wrote"),
                       (str(tmp_path / "partial"), "has no manifest.json: its preparation did not finish; rerun the "
                                                   "same launch/prepare_data.py command to complete it"),
                       (str(tmp_path / "other"), "has no manifest.json: not a shard directory; write one with "
                                                 "launch/prepare_data.py")):
        with pytest.raises(shard_lib.ShardError) as e:
            shard_lib.read_manifest(path)
        assert str(e.value) == f"{path!r} {want}"
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"format": "parallax-shards/9"}, f)
    with pytest.raises(shard_lib.ShardError) as e:
        shard_lib.read_manifest(d)
    assert str(e.value) == (f"{os.path.join(d, 'manifest.json')}: not a readable shard manifest (ValueError: format "
                            f"'parallax-shards/9', expected one of {shard_lib.FORMATS}); prepare the directory again "
                            "with launch/prepare_data.py")
