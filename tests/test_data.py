"""Tests for parallax.data: determinism, host slicing, packing invariants, splits, sources, errors."""
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from parallax import data

KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


@pytest.fixture(scope="module")
def synthetic():
    return data.make_dataset("synthetic", seq_len=32, global_batch_size=8, seed=3, vocab_size=64)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """40 small files, each a unique marker repeated, in nested directories."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(f"<doc{i:02d}>" * (3 + i % 5))
    (root / "binary.dat").write_bytes(b"\0\1\2")
    return root


def _write_tokens(tmp_path, name, docs, eos_id, dtype):
    tokens = np.concatenate([np.append(d, eos_id) for d in docs]).astype(dtype)
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    return str(path), tokens


def _check_packing(batch):
    """Invariants every batch must satisfy, row by row."""
    for key in KEYS:
        assert batch[key].dtype == (np.float32 if key == "weights" else np.int32), key
    seg, pos, w = batch["segment_ids"], batch["positions"], batch["weights"]
    for r in range(seg.shape[0]):
        real = seg[r] > 0
        assert np.all(np.diff(real.astype(int)) <= 0), "padding only at the end of a row"
        s = seg[r][real]
        assert s[0] == 1 and np.all(np.diff(s) >= 0) and np.all(np.diff(s) <= 1)
        assert pos[r][0] == 0, "a row starts at position 0, also in the middle of a document"
        new_doc = np.flatnonzero(np.diff(s)) + 1
        assert np.all(pos[r][new_doc] == 0), "positions restart at each new document"
        same = np.flatnonzero(np.diff(s) == 0)
        assert np.all(pos[r][same + 1] == pos[r][same] + 1), "positions count up within a document"
        # Within a document, the target is the next input; at a document end or padding, weight is 0.
        assert np.all(w[r][same] == 1.0)
        assert np.all(batch["targets"][r][same] == batch["inputs"][r][same + 1])
        assert np.all(w[r][new_doc - 1] == 0.0), "no weight across a document boundary"
        assert np.all(w[r][~real] == 0.0), "no weight on padding"


def test_same_seed_and_step_give_identical_batches_and_steps_differ(synthetic):
    again = data.make_dataset("synthetic", seq_len=32, global_batch_size=8, seed=3, vocab_size=64)
    a, b, c = synthetic.batch(5), again.batch(5), synthetic.batch(6)
    for key in KEYS:
        np.testing.assert_array_equal(a[key], b[key])
        assert a[key].shape == (8, 32)
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert not np.array_equal(a["inputs"], synthetic.batch(5, "eval")["inputs"])
    other_seed = data.make_dataset("synthetic", seq_len=32, global_batch_size=8, seed=4, vocab_size=64)
    assert not np.array_equal(a["inputs"], other_seed.batch(5)["inputs"])


def test_batch_does_not_depend_on_what_was_read_before(synthetic):
    first = synthetic.batch(9)["inputs"]
    for step in range(3):
        synthetic.batch(step, "eval")
    np.testing.assert_array_equal(first, synthetic.batch(9)["inputs"])


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_host_slices_concatenate_to_the_global_batch(synthetic, process_count):
    whole = synthetic.batch(7)
    parts = [synthetic.batch(7, process_index=i, process_count=process_count) for i in range(process_count)]
    for key in KEYS:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_synthetic_rows_satisfy_packing_invariants_and_cross_documents(synthetic):
    batch = synthetic.batch(0)
    _check_packing(batch)
    assert batch["segment_ids"].max() > 1, "rows should pack several documents"
    assert batch["inputs"].max() < 64
    assert batch["weights"].mean() > 0.9


def test_synthetic_eos_is_appended_and_never_drawn_otherwise():
    ds = data.make_dataset("synthetic", seq_len=64, global_batch_size=4, seed=0, vocab_size=16, eos_id=5)
    batch = ds.batch(1)
    _check_packing(batch)
    seg, inputs = batch["segment_ids"], batch["inputs"]
    doc_end = np.zeros_like(seg, bool)
    doc_end[:, :-1] = seg[:, 1:] != seg[:, :-1]
    np.testing.assert_array_equal(inputs[doc_end], 5)
    assert np.all(inputs[:, :-1][~doc_end[:, :-1]] != 5)


def test_text_eval_documents_never_appear_in_train(text_dir):
    ds = data.make_dataset("text", str(text_dir), seq_len=48, global_batch_size=8, seed=0,
                           vocab_size=256, eval_fraction=0.3)

    def markers(split):
        found = set()
        for step in range(30):
            for row in ds.batch(step, split)["inputs"]:
                found |= set(re.findall(rb"<doc(\d\d)>", row.astype(np.uint8).tobytes()))
        return found

    train, held_out = markers("train"), markers("eval")
    assert train and held_out and not train & held_out
    assert len(train | held_out) >= 35, "nearly every document is reachable"
    _check_packing(ds.batch(0))
    assert "text: 40 documents" in ds.describe()


def test_text_split_is_stable_when_files_are_added(text_dir, tmp_path):
    before = data.make_dataset("text", str(text_dir), seq_len=16, global_batch_size=2, seed=0,
                               vocab_size=256, eval_fraction=0.3)
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    for f in text_dir.rglob("*.txt"):
        (bigger / f.parent.name).mkdir(exist_ok=True)
        (bigger / f.parent.name / f.name).write_bytes(f.read_bytes())
    (bigger / "d0" / "zz_new.txt").write_text("<new>" * 9)
    after = data.make_dataset("text", str(bigger), seq_len=16, global_batch_size=2, seed=0,
                              vocab_size=256, eval_fraction=0.3)
    def eval_markers(ds):
        return set(re.findall(rb"<doc\d\d>", ds.streams["eval"].tokens.tobytes()))

    assert eval_markers(before) and eval_markers(before) == eval_markers(after)


def test_stdlib_text_default_loads_within_max_bytes():
    ds = data.make_dataset("text", "", seq_len=64, global_batch_size=4, seed=0, vocab_size=256,
                           max_bytes=1 << 20)
    assert sum(len(s.tokens) for s in ds.streams.values() if s is not None) <= 1 << 20
    _check_packing(ds.batch(0))
    assert ds.describe().startswith("text: ")


def test_short_eval_stream_is_padded_with_zero_weight(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world!")
    (tmp_path / "long.txt").write_text("x" * 40)
    ds = data.make_dataset("text", str(tmp_path), seq_len=16, global_batch_size=2, seed=0,
                           vocab_size=256, eval_fraction=0.0)
    ds = data.Dataset(ds.source, ds.seq_len, 2, 256, 0,
                      {"train": ds.streams["train"], "eval": data._Stream(ds.streams["train"].tokens[:11],
                                                                          np.array([0, 5]))})
    batch = ds.batch(0, "eval")
    _check_packing(batch)
    np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 5 + [2] * 6 + [0] * 5)
    np.testing.assert_array_equal(batch["positions"][0][:11], list(range(5)) + list(range(6)))
    assert batch["inputs"][0][:11].astype(np.uint8).tobytes() == b"helloworld!"
    assert batch["weights"][0].sum() == 4 + 5
    # past the stream's end every field is 0 (the targets from the 11th, the last real input's target)
    for key, real in [("inputs", 11), ("targets", 10), ("positions", 11), ("segment_ids", 11), ("weights", 10)]:
        assert not batch[key][0][real:].any(), key
    assert batch["targets"][0][:10].astype(np.uint8).tobytes() == b"elloworld!"
    # a stream of exactly seq_len tokens has one start (offset 0) under both samplers; the target of its
    # last input is padding
    for sampler in ("random", "epoch"):
        exact = data.Dataset(ds.source, 16, 2, 256, 0, {"train": ds.streams["train"], "eval": data._Stream(
            ds.streams["train"].tokens[:16], np.array([0]))}, sampler)
        rows = exact.batch(3, "eval")
        np.testing.assert_array_equal(rows["inputs"], np.tile(ds.streams["train"].tokens[:16], (2, 1)))
        np.testing.assert_array_equal(rows["weights"][:, -1], [0, 0])


def test_train_stream_shorter_than_a_row_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world!")
    with pytest.raises(data.DataError, match=r"has 11 training tokens, fewer than seq_len \+ 1 = 17; lower seq_len"):
        data.make_dataset("text", str(tmp_path), seq_len=16, global_batch_size=2, seed=0, vocab_size=256,
                          eval_fraction=0.0)
    assert len(data.make_dataset("text", str(tmp_path), seq_len=10, global_batch_size=2, seed=0, vocab_size=256,
                                 eval_fraction=0.0).streams["train"].tokens) == 11


@pytest.mark.parametrize("content", [b"garbage, not numpy", "truncated", "objects"])
def test_corrupt_npy_token_file_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "corpus.npy"
    if content == "truncated":
        np.save(path, np.arange(1000, dtype=np.int32))
        path.write_bytes(path.read_bytes()[:300])
    elif content == "objects":
        np.save(path, np.array([object()], dtype=object))
    else:
        path.write_bytes(content)
    with pytest.raises(data.DataError, match=r"token file '.*corpus.npy' is not a (readable )?.npy (array|file) .*np.save") as info:
        data.make_dataset("tokens", str(path), seq_len=4, global_batch_size=2, seed=0, vocab_size=512, eos_id=0)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,dtype", [("corpus.uint16.bin", np.uint16), ("corpus.uint32.bin", np.uint32),
                                        ("corpus.npy", np.int32)])
def test_token_file_sources_pack_documents_split_at_eos(tmp_path, name, dtype):
    rng = np.random.default_rng(0)
    vocab = 70000 if dtype == np.uint32 else 1000
    docs = [rng.integers(1, vocab, int(rng.integers(5, 40))) for _ in range(60)]
    path, tokens = _write_tokens(tmp_path, name, docs, 0, dtype)
    ds = data.make_dataset("tokens", path, seq_len=24, global_batch_size=4, seed=1, vocab_size=vocab,
                           eos_id=0, eval_fraction=0.2)
    train, held_out = ds.streams["train"], ds.streams["eval"]
    assert len(train.tokens) + len(held_out.tokens) == len(tokens)
    assert train.tokens[-1] == 0, "the split is cut at a document boundary"
    assert len(held_out.tokens) == pytest.approx(0.2 * len(tokens), abs=40)
    for split in ("train", "eval"):
        batch = ds.batch(2, split)
        _check_packing(batch)
        seg, inputs = batch["segment_ids"], batch["inputs"]
        last_of_doc = seg[:, :-1] != seg[:, 1:]
        np.testing.assert_array_equal(inputs[:, :-1][last_of_doc], 0)
        assert inputs.max() < vocab


def test_token_positions_count_from_the_documents_first_token_in_the_row(tmp_path):
    docs = [np.arange(1, 101), np.arange(1, 4)]  # a 100-token document (token id == true position + 1), then 3
    path, _ = _write_tokens(tmp_path, "two.uint16.bin", docs, 0, np.uint16)
    ds = data.make_dataset("tokens", path, seq_len=10, global_batch_size=16, seed=0, vocab_size=128,
                           eos_id=0, eval_fraction=0.0)
    batch = ds.batch(3)
    _check_packing(batch)
    first = batch["segment_ids"] == 1
    assert batch["inputs"][:, 0].max() > 10, "some row starts deep in the long document"
    np.testing.assert_array_equal(batch["positions"][first], np.nonzero(first)[1])  # 0, 1, ... from the row start
    assert batch["positions"].max() < ds.seq_len


@pytest.mark.parametrize("kwargs,match", [
    (dict(source="parquet"), r"source='parquet' is unknown; use 'synthetic', 'text' or 'tokens'"),
    (dict(source="text", vocab_size=128), r"vocab_size=128 is too small for source='text'.*>= 256"),
    (dict(source="synthetic", vocab_size=8), r"vocab_size=8 .* use >= 16"),
    (dict(source="text", path="/no/such/dir"), r"'/no/such/dir' is not a directory"),
    (dict(source="tokens", path=__file__), r"needs eos_id .* pass eos_id="),
    (dict(source="tokens", path="/no/such.uint16.bin"), r"^path='/no/such.uint16.bin': no such token file"),
    (dict(source="tokens", path="/no/shards"), r"^path='/no/shards': no such directory; pass a shard directory"),
    (dict(source="synthetic", eval_fraction=1.0), r"eval_fraction=1.0 must be in \[0, 1\)"),
])
def test_bad_configs_raise_data_error_naming_the_fix(kwargs, match):
    args = dict(path="", seq_len=8, global_batch_size=4, seed=0, vocab_size=512) | kwargs
    with pytest.raises(data.DataError, match=match):
        data.make_dataset(args.pop("source"), args.pop("path"), **args)


def test_token_errors_name_the_bad_file_contents(tmp_path):
    path, _ = _write_tokens(tmp_path, "big.uint16.bin", [np.array([1, 2, 900])], 0, np.uint16)
    with pytest.raises(data.DataError, match=r"holds id 900, outside vocab_size=512"):
        data.make_dataset("tokens", path, seq_len=4, global_batch_size=2, seed=0, vocab_size=512, eos_id=0)
    odd = tmp_path / "c.tokens"
    odd.write_bytes(b"\1\0")
    with pytest.raises(data.DataError, match=r"NAME.uint16.bin, NAME.uint32.bin or NAME.npy"):
        data.make_dataset("tokens", str(odd), seq_len=4, global_batch_size=2, seed=0, vocab_size=512,
                          eos_id=0)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(data.DataError, match=r"has no training documents"):
        data.make_dataset("text", str(empty_dir), seq_len=4, global_batch_size=2, seed=0, vocab_size=256)


def test_batch_arguments_outside_their_range_are_one_line_data_errors(synthetic):
    for kwargs, message in [
            (dict(process_index=2, process_count=2), "process_index=2 is outside [0, 2); pass jax.process_index()"),
            (dict(process_index=-1), "process_index=-1 is outside [0, 1); pass jax.process_index()"),
            (dict(step=-1), "step=-1 is negative; steps count from 0"),
            (dict(rows=(3, 3)), "rows=(3, 3) is not a row range of the global batch of 8"),
            (dict(rows=(4, 9)), "rows=(4, 9) is not a row range of the global batch of 8")]:
        with pytest.raises(data.DataError) as e:
            synthetic.batch(kwargs.pop("step", 0), **kwargs)
        assert str(e.value) == message
    assert synthetic.batch(0, process_index=1, process_count=2)["inputs"].shape[0] == 4
    assert synthetic.batch(0, rows=(7, 8))["inputs"].shape[0] == 1


def test_a_stream_shorter_than_two_rows_still_has_one_window():
    assert data._num_windows(5, 8) == data._num_windows(9, 8) == 1 and data._num_windows(17, 8) == 2


def test_indivisible_batch_and_missing_eval_raise_data_error(synthetic, tmp_path):
    with pytest.raises(data.DataError, match=r"global_batch_size=8 is not divisible by process_count=3"):
        synthetic.batch(0, process_count=3)
    with pytest.raises(data.DataError, match=r"split='test' is unknown"):
        synthetic.batch(0, "test")
    (tmp_path / "a.txt").write_text("abcde")
    ds = data.make_dataset("text", str(tmp_path), seq_len=4, global_batch_size=2, seed=0, vocab_size=256,
                           eval_fraction=0.0)
    with pytest.raises(data.DataError, match=r"'eval' split .* has no documents; raise eval_fraction"):
        ds.batch(0, "eval")


def test_to_global_builds_arrays_sharded_over_data(synthetic):
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    local = synthetic.batch(4)
    arrays = data.to_global(local, sharding, synthetic.global_batch_size)
    for key in KEYS:
        assert arrays[key].shape == (8, 32) and arrays[key].sharding == sharding
        assert len(arrays[key].addressable_shards) == 8
        np.testing.assert_array_equal(np.asarray(arrays[key]), local[key])


def test_host_rows_follow_the_batch_sharding():
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    by_data = NamedSharding(mesh, P("data", "seq"))
    assert data.host_rows(by_data, (16, 8)) == (0, 16)  # one process holds every row
    replicated = NamedSharding(mesh, P(None, "seq"))
    assert data.host_rows(replicated, (16, 8)) == (0, 16)


def test_token_index_is_cached_beside_the_file_and_rebuilt_when_it_changes(tmp_path, monkeypatch):
    calls = []
    scan = data._scan_tokens
    monkeypatch.setattr(data, "_scan_tokens", lambda *a: calls.append(1) or scan(*a))
    path, _ = _write_tokens(tmp_path, "c.uint16.bin", [np.arange(1, 30), np.arange(5, 9)], 0, np.uint16)

    def load(eos_id=0):
        ds = data.make_dataset("tokens", path, seq_len=4, global_batch_size=2, seed=0, vocab_size=64,
                               eos_id=eos_id, eval_fraction=0.0)
        return ds.streams["train"].starts.tolist()

    first = load()
    assert first == [0, 30] and len(calls) == 1 and os.path.exists(path + ".index.npz")
    mode = os.stat(path + ".index.npz").st_mode & 0o777  # as readable as a file the user writes (umask)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask, oct(mode)
    assert load() == first and len(calls) == 1, "the second start reads the index, it does not rescan"
    assert load(eos_id=5) == [0, 5, 31] and len(calls) == 2, "another eos id is another index"
    np.append(np.arange(1, 40), 0).astype(np.uint16).tofile(path)  # the file changed: size and mtime
    assert load() == [0] and len(calls) == 3
    with pytest.raises(data.DataError, match=r"holds id 39, outside vocab_size=32"):  # checked from the index
        data.make_dataset("tokens", path, seq_len=4, global_batch_size=2, seed=0, vocab_size=32, eos_id=0)
    assert len(calls) == 3


@pytest.mark.parametrize("batch_size, tail", [(4, 0), (3, 0), (4, 6)])
def test_epoch_sampler_visits_every_window_once_per_epoch(tmp_path, batch_size, tail):
    # 40 windows of 9 tokens starting every 8; a tail too short for a 41st window is never read as one
    n, seq_len = 8 * 40 + 1 + tail, 8
    path = tmp_path / "ramp.uint32.bin"
    np.append(np.arange(1, n), 0).astype(np.uint32).tofile(path)  # token i+1 at offset i: inputs name offsets
    kwargs = dict(seq_len=seq_len, global_batch_size=batch_size, seed=3, vocab_size=n + 1, eos_id=0,
                  eval_fraction=0.0, sampler="epoch")
    ds = data.make_dataset("tokens", str(path), **kwargs)
    starts = np.concatenate([ds.batch(step)["inputs"][:, 0] - 1 for step in range((80 + batch_size - 1) // batch_size)])
    first, second = starts[:40], starts[40:80]
    assert sorted(first) == sorted(second) == list(range(0, 40 * seq_len, seq_len))
    assert list(first) != list(second), "each epoch has its own order"
    assert ds.epoch(40 // batch_size) == pytest.approx(40 // batch_size * batch_size / 40)
    again = data.make_dataset("tokens", str(path), **kwargs)  # a restart: step 6 alone gives step 6's batch
    np.testing.assert_array_equal(again.batch(6)["inputs"], ds.batch(6)["inputs"])


def test_random_sampler_draws_every_window_start_from_the_first_to_the_last(tmp_path):
    # A stream of seq_len + 3 tokens has exactly 3 windows of seq_len + 1 tokens: starts 0, 1 and 2.
    seq_len = 8
    path = tmp_path / "ramp.uint32.bin"
    np.append(np.arange(1, seq_len + 3), 0).astype(np.uint32).tofile(path)  # token i+1 at offset i
    ds = data.make_dataset("tokens", str(path), seq_len=seq_len, global_batch_size=16, seed=0,
                           vocab_size=seq_len + 4, eos_id=0, eval_fraction=0.0)
    starts = np.concatenate([ds.batch(step)["inputs"][:, 0] - 1 for step in range(4)])
    assert set(starts.tolist()) == {0, 1, 2}


def test_a_packed_rows_weights_are_its_masks_within_each_document():
    """`_pack_row` by hand: two documents (starts 0, 3) and a mask of ones: the prediction across the boundary
    (token 2 -> token 3) and the padding weigh 0; a mask zero drops its target."""
    tokens, starts = np.array([7, 8, 9, 4, 5]), np.array([0, 3])
    row = data._pack_row(tokens, starts, 6, mask=np.ones(5, bool))
    np.testing.assert_array_equal(row["weights"], [1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(row["inputs"], [7, 8, 9, 4, 5, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0])
    masked = data._pack_row(tokens, starts, 6, mask=np.array([1, 0, 1, 1, 1], bool))
    np.testing.assert_array_equal(masked["weights"], [0, 1, 0, 1, 0, 0])


def test_byte_level_text_needs_256_ids():
    import ml_collections

    from parallax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^config.model.vocab_size=255: byte-level text needs vocab_size >= 256$"):
        data.check_source(ml_collections.ConfigDict({"source": "text"}), 255)
    data.check_source(ml_collections.ConfigDict({"source": "text"}), 256)
    data.check_source(ml_collections.ConfigDict({"source": "tokens"}), 255)  # a tokenizer's ids: no such bound
