"""Generation (parallax/generate.py): KV-cache decode equals the window-recomputing sampler token for token on
every shipped model, a batch of prompts of different lengths; on an fsdp x tensor mesh it equals one device;
the sampling options and the errors."""

import os

import jax
import numpy as np
import pytest

from helpers import ROOT, tiny_config
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.generate import generate
from parallax.sharding import activation_sharding
from parallax.trainer import Trainer

PROMPTS = [[5, 9, 11, 3, 7], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]  # lengths 5, 1, 11
NEW = 20


def _config(model, **mesh):
    if model == "moe":
        config = load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
        for axis in config.mesh:
            config.mesh[axis] = mesh.get(axis, 1)
        # the config's capacity dispatch: decoding routes dropless (models/moe.py), or a prompt's drops
        # would depend on the padding and the tokens sharing its group
        assert config.model.moe.dispatch == "capacity"
    else:
        config = tiny_config(model, **mesh)
    config.model.init_std = 0.3  # random weights whose greedy continuations are not one repeated token
    return config


def _model(config, devices=1):
    trainer = Trainer(config, devices=jax.devices()[:devices])
    return trainer, trainer.init_state(0)["params"]


def _generate(trainer, params, prompts=PROMPTS, num_tokens=NEW, **kwargs):
    with activation_sharding(trainer.mesh, trainer.plan.rules):
        return generate(trainer.graphdef, params, prompts, num_tokens, trainer.config.train.seq_len,
                        par=trainer.plan.parallelism, vocab_size=trainer.config.model.vocab_size, **kwargs)


@pytest.fixture(scope="module")
def llama():
    return _model(_config("llama"))


@pytest.mark.parametrize("model", ["llama", "gpt2", "moe"])
def test_kv_cache_decode_equals_the_window_sampler(model, llama):
    trainer, params = llama if model == "llama" else _model(_config(model))
    for kwargs in (dict(), dict(temperature=1.0, seed=5)):  # greedy; sampled: the same draws from the same logits
        cached = _generate(trainer, params, cache=True, **kwargs)
        window = _generate(trainer, params, cache=False, **kwargs)
        for row, (a, b) in enumerate(zip(cached, window)):
            if kwargs:
                assert len(set(b.tolist())) >= 8, (row, b)  # a continuation that can tell a wrong position apart
            np.testing.assert_array_equal(a, b, err_msg=f"{model} row {row} {kwargs}")


def test_decode_on_fsdp_tensor_mesh_equals_one_device(llama):
    trainer, params = llama
    mesh_trainer, mesh_params = _model(_config("llama", fsdp=2, tensor=2), devices=4)
    assert "tensor" in str(jax.tree.leaves(mesh_params)[-1].sharding.spec) or any(
        "tensor" in str(leaf.sharding.spec) for leaf in jax.tree.leaves(mesh_params))
    for kwargs in (dict(), dict(temperature=1.0, top_k=20, top_p=0.9, seed=3)):
        one = _generate(trainer, params, **kwargs)
        sharded = _generate(mesh_trainer, mesh_params, **kwargs)
        for a, b in zip(one, sharded):
            np.testing.assert_array_equal(a, b, err_msg=str(kwargs))


def test_moe_decode_on_an_expert_mesh_equals_one_device():
    """Experts sharded over `expert` (and FSDP): the compiler partitions the dropless decode."""
    one = _generate(*_model(_config("moe")))
    for a, b in zip(one, _generate(*_model(_config("moe", fsdp=2, expert=2), devices=4))):
        np.testing.assert_array_equal(a, b)


def test_a_prompt_decodes_the_same_alone_and_in_a_batch():
    trainer, params = _model(_config("moe"))
    batched = _generate(trainer, params)
    for prompt, row in zip(PROMPTS, batched):
        np.testing.assert_array_equal(_generate(trainer, params, [prompt])[0], row)


def test_sampling_options_and_eos(llama):
    trainer, params = llama
    greedy = _generate(trainer, params)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6)):  # one candidate left: sampling is greedy
        for a, b in zip(_generate(trainer, params, temperature=1.5, seed=7, **kwargs), greedy):
            np.testing.assert_array_equal(a, b, err_msg=str(kwargs))
    sampled = [_generate(trainer, params, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert all(np.array_equal(a, b) for a, b in zip(sampled[0], sampled[1]))  # a seed gives one sample
    assert not all(np.array_equal(a, b) for a, b in zip(sampled[0], sampled[2]))
    eos = int(greedy[0][2])
    stopped = _generate(trainer, params, eos_id=eos)
    for a, g in zip(stopped, greedy):  # each row ends before its first eos
        first = np.flatnonzero(g == eos)
        np.testing.assert_array_equal(a, g[: first[0]] if len(first) else g)
    assert len(stopped[0]) == 2


def _sampling_reference(logits, temperature, top_k, top_p):
    """Per row, the distribution `sample_logits` must draw from, by hand in float64: softmax at the
    temperature over the top_k largest logits (all tied with the k-th kept), then, in order of probability,
    each token whose higher-ranked tokens hold less than top_p of that softmax."""
    out = np.zeros_like(logits, np.float64)
    for row, z in enumerate(np.asarray(logits, np.float64) / temperature):
        keep = z >= np.sort(z)[::-1][top_k - 1] if top_k else np.ones(z.shape, bool)
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        p /= p.sum()
        ranked, mass = np.argsort(-p, kind="stable"), 0.0
        for t in ranked:
            if mass >= top_p:
                p[t] = 0.0
            mass += p[t] if p[t] else 0.0
        out[row] = p / p.sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.5, 4, 1.0), (0.8, 0, 0.6), (1.3, 5, 0.7),
                                                     (0.5, 3, 0.9)])
def test_sampling_draws_from_the_tempered_top_k_top_p_distribution(temperature, top_k, top_p):
    """Temperature, top-k and top-p together: 40,000 draws per row land only on the tokens the by-hand
    distribution allows, each as often as it says (within 5 standard errors)."""
    from parallax.generate import sample_logits

    rng = np.random.default_rng(int(temperature * 10) + 100 * top_k)
    logits = (rng.normal(size=(3, 10)) * 2).astype(np.float32)
    want = _sampling_reference(logits, temperature, top_k, top_p)
    draws = 40_000
    keys = jax.random.split(jax.random.key(0), draws)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample_logits(logits, k, temperature, top_k, top_p)))(keys))
    for row in range(logits.shape[0]):
        freq = np.bincount(tokens[:, row], minlength=logits.shape[1]) / draws
        assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want[row])), (row, freq, want[row])
        err = np.abs(freq - want[row]) / np.sqrt(want[row] * (1 - want[row]) / draws + 1e-12)
        assert err.max() < 5, (row, freq.round(4), want[row].round(4))
    if top_k or top_p < 1:  # the options cut something
        assert (want == 0).any()


def test_sampling_by_default_keeps_every_token():
    """`sample_logits` with its defaults (top_k 0, top_p 1) cuts nothing: near-equal logits give every token."""
    from parallax.generate import sample_logits

    keys = jax.random.split(jax.random.key(1), 200)
    tokens = jax.vmap(lambda k: sample_logits(np.array([[0.0, -0.1, -0.2, -0.3]], np.float32), k, 1.0))(keys)
    assert set(np.asarray(tokens).ravel().tolist()) == {0, 1, 2, 3}


def test_top_p_reached_exactly_by_the_tokens_above_cuts_the_next_one():
    """Probabilities 1/2, 1/4, 1/4 (exact in fp32) at top_p 0.5: the top token alone holds 0.5, so the
    smallest set holding top_p is that token; the second (exactly 0.5 above it) is cut."""
    from parallax.generate import sample_logits

    logits = np.log(np.array([[0.5, 0.25, 0.25]], np.float32))
    keys = jax.random.split(jax.random.key(2), 200)
    tokens = jax.vmap(lambda k: sample_logits(logits, k, 1.0, 0, 0.5))(keys)
    assert set(np.asarray(tokens).ravel().tolist()) == {0}
    tokens = jax.vmap(lambda k: sample_logits(logits, k, 1.0, 0, 0.75))(keys)
    assert set(np.asarray(tokens).ravel().tolist()) == {0, 1}


def test_bad_inputs_are_one_line_errors(llama):
    trainer, params = llama
    seq = trainer.config.train.seq_len
    for prompts, kwargs, match in (([[1], []], {}, "prompt 1 is empty"),
                                   ([[1, 999]], {}, "token id 999 outside the vocabulary"),
                                   ([[1, trainer.config.model.vocab_size]], {},  # one past the last id
                                    f"token id {trainer.config.model.vocab_size} outside the vocabulary"),
                                   ([[1]], dict(top_p=0.0), "top_p=0.0"),
                                   ([[1]], dict(temperature=-1), "temperature=-1")):
        with pytest.raises(ConfigError, match=match):
            _generate(trainer, params, prompts, **kwargs)


def test_prompts_pad_to_the_rows_with_copies_of_the_first_and_any_id_in_the_vocabulary_is_kept():
    """`_pad_prompts` by hand: right-padded int32 rows, the extra rows copies of prompt 0, ids 0 and
    vocab_size - 1 kept; no prompts at all is one line."""
    from parallax.generate import _pad_prompts

    out, lengths = _pad_prompts([np.array([0, 9]), np.array([3])], 10, 4)
    np.testing.assert_array_equal(out, [[0, 9], [3, 0], [0, 9], [0, 9]])
    np.testing.assert_array_equal(lengths, [2, 1, 2, 2])
    assert out.dtype == lengths.dtype == np.int32
    with pytest.raises(ConfigError, match="^generate: no prompts$"):
        _pad_prompts([], 10, 1)


def test_the_batch_splits_over_the_mesh_axes_its_rule_names():
    """`_batch_shards`: the product of the mesh sizes of the axes the `batch` rule names (a name or a
    tuple; axes this mesh lacks count 1), 1 outside a sharding context or without a batch rule."""
    import types

    from parallax.generate import _batch_shards

    assert _batch_shards() == 1
    mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 3, "tensor": 5})
    for rule, want in ((("data", "fsdp"), 6), ("fsdp", 3), (("data", "pipe"), 2), (None, 1)):
        with activation_sharding(mesh, {"batch": rule, "embed": "tensor"}):
            assert _batch_shards() == want, rule
    with activation_sharding(mesh, {"embed": "tensor"}):
        assert _batch_shards() == 1


def test_past_the_window_the_cache_decodes_in_rounds(llama):
    """Prompt + new tokens > seq_len: rounds that restart from each row's last seq_len // 2 tokens. Until the
    window is full the tokens are the recomputing sampler's; the second round is a cached decode of its prompt."""
    trainer, params = llama
    seq = trainer.config.train.seq_len
    prompts = [PROMPTS[0], PROMPTS[2]]
    first = seq - len(prompts[1])  # the first round fills the window of the longest prompt
    long = _generate(trainer, params, prompts, num_tokens=first + seq // 2 + 3)
    window = _generate(trainer, params, prompts, num_tokens=first, cache=False)
    for row, (a, w, p) in enumerate(zip(long, window, prompts)):
        assert len(a) == first + seq // 2 + 3
        np.testing.assert_array_equal(a[:first], w)
        tail = (list(p) + a[:first].tolist())[-(seq // 2):]  # round two's prompt
        again = _generate(trainer, params, [tail], num_tokens=seq // 2, cache=False)[0]
        np.testing.assert_array_equal(a[first:first + seq // 2], again, err_msg=f"row {row}")


def test_a_prompt_longer_than_the_window_decodes_as_the_part_the_model_sees(llama):
    """`prompt_kept` (what `launch/sample.py`'s warning says the model sees) is the truth: a prompt past the
    window continues exactly as its last `prompt_kept` tokens alone do, with the cache and without."""
    from parallax.generate import prompt_kept

    trainer, params = llama
    seq = trainer.config.train.seq_len
    long = (PROMPTS[2] * 8)[: seq + 3]
    for cache in (True, False):
        kept = prompt_kept(len(long), seq, cache)
        assert kept < len(long) and prompt_kept(seq - 1, seq, cache) == seq - 1
        np.testing.assert_array_equal(_generate(trainer, params, [long], num_tokens=4, cache=cache)[0],
                                      _generate(trainer, params, [long[-kept:]], num_tokens=4, cache=cache)[0])


def test_a_model_whose_embed_attends_falls_back_to_the_window():
    config = _config("moe")
    config.model.moe.update(first_dense=1, dense_d_ff=64)
    trainer, params = _model(config)
    with pytest.raises(ConfigError, match="embed attends"):
        _generate(trainer, params, num_tokens=3, cache=True)
    for a, b in zip(_generate(trainer, params, num_tokens=3), _generate(trainer, params, num_tokens=3, cache=False)):
        np.testing.assert_array_equal(a, b)


def test_sample_launcher_batches_prompts_on_a_mesh(tmp_path):
    """`launch/sample.py` with two prompts, sharded over data x tensor on simulated devices: one block per
    prompt; a bad --mesh is one line and exit 2."""
    from helpers import run_launcher
    from parallax.train import train_and_evaluate

    config = tiny_config()
    config.train.update(steps=1, checkpoint_every=1, eval_every=0, log_every=1)
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir, devices=jax.devices()[:1], log=lambda *_: None)
    done = run_launcher("sample", f"--workdir={workdir}", "--prompt=ab", "--prompt=abcdef", "--tokens=3",
                        "--mesh=data=2,tensor=2", "--cpu_devices=4", timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step 1 sample")]
    assert len(lines) == 2 and all(len(line.split(":")[-1].split()) == 3 for line in lines), done.stdout
    bad = run_launcher("sample", f"--workdir={workdir}", "--mesh=tensor", timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "config error: --mesh=tensor: 'tensor' is not axis=size with a positive size, e.g. fsdp=2,tensor=2"]
