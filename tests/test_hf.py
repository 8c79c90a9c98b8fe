"""Hugging Face interop (`parallax/hf.py`): logits parity with `transformers`, bitwise export -> import,
sharded loading onto an fsdp x tensor mesh, and the import / export launchers.

The HF checkpoints are tiny random models the tests create with `transformers` (no downloads), with random
norm scales and biases so that a mapping that drops or swaps one of them shows in the logits."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs a CPU torch (installed by '.[dev]' on Python < 3.12)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers ('.[dev]' on Python < 3.12)")
pytest.importorskip("safetensors", reason="parallax.hf needs safetensors")

from flax import nnx  # noqa: E402

from parallax import hf  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.model import forward  # noqa: E402
from parallax.trainer import Trainer  # noqa: E402
from helpers import ROOT, read_metrics, run_launcher  # noqa: E402

TOL = 1e-4  # max abs logits error vs transformers, fp32


def _randomize(model, seed):
    """Random values for every norm scale and bias (HF initialises them to 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=gen))


def _make_llama(path, **changes):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2), **changes})
    model = transformers.LlamaForCausalLM(config).float().eval()
    _randomize(model, 1)
    model.save_pretrained(path)
    return model


def _make_gpt2(path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                                     layer_norm_epsilon=1e-5, initializer_range=0.2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).float().eval()
    _randomize(model, 2)
    model.save_pretrained(path)
    return model


MAKERS = {"llama": _make_llama, "gpt2": _make_gpt2,
          # a tied head (no lm_head.weight in the file), head_dim 16 != d_model / heads, 4 query heads per kv head
          "llama_tied": lambda path: _make_llama(path, tie_word_embeddings=True, head_dim=16, num_key_value_heads=1)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF dir, the transformers model)."""
    out = {}
    for name, make in MAKERS.items():
        path = str(tmp_path_factory.mktemp(f"hf_{name}"))
        out[name] = (path, make(path))
    return out


def _tokens(seed=0, shape=(2, 24)):
    return np.random.default_rng(seed).integers(0, 64, shape).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _import(hf_dir, devices=None, **mesh):
    """(trainer, params) for hf_dir on `devices` (default one) with the given mesh sizes (others 1)."""
    ckpt = hf.Checkpoint(hf_dir)
    overrides = [(f"mesh.{a}", str(mesh.get(a, 1))) for a in ("data", "fsdp", "pipe", "expert", "seq", "tensor")]
    config = hf.import_config(ckpt, None, overrides)
    trainer = Trainer(config, devices=devices or jax.devices()[:1])
    return trainer, hf.load_params(ckpt, trainer.plan.model_config, trainer.param_shardings)


def _our_logits(trainer, params, tokens):
    model = nnx.merge(trainer.graphdef, params)
    B, T = tokens.shape
    batch = {"inputs": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}
    par = trainer.plan.parallelism
    return np.asarray(model.logits(forward(model, batch, par=par), par))


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama_tied"])
def test_imported_logits_match_transformers_fp32(checkpoints, name):
    hf_dir, model = checkpoints[name]
    if name == "llama_tied":  # the head is read from the embedding
        assert "lm_head.weight" not in hf.Checkpoint(hf_dir).files
    trainer, params = _import(hf_dir)
    tokens = _tokens()
    ours, ref = _our_logits(trainer, params, tokens), _hf_logits(model, tokens)
    err = float(np.max(np.abs(ours - ref)))
    print(f"{name}: max abs logits error {err:.2e} (logits std {ref.std():.2f})")
    assert ref.std() > 0.5  # a non-trivial model: the test can fail
    assert err <= TOL


@pytest.mark.parametrize("name,shard_bytes", [("llama", 20_000), ("gpt2", 5 << 30)])
def test_export_import_roundtrips_bitwise_and_loads_in_transformers(checkpoints, tmp_path, name, shard_bytes):
    hf_dir, _ = checkpoints[name]
    trainer, params = _import(hf_dir)
    out = str(tmp_path / "export")
    files = hf.export_params(params, trainer.plan.model_config, out, max_shard_bytes=shard_bytes)
    assert (hf.INDEX_FILE in files) == (shard_bytes < 1 << 20), files  # the small limit shards the export
    again, params2 = _import(out)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params2)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens = _tokens(1)
    err = float(np.max(np.abs(_hf_logits(exported, tokens) - _our_logits(trainer, params, tokens))))
    print(f"{name}: exported model in transformers vs ours: max abs logits error {err:.2e}")
    assert err <= TOL


def test_llama_export_writes_the_original_tensors_bitwise(checkpoints, tmp_path):
    """Llama's mapping loses nothing: the exported tensors are the imported checkpoint's, bit for bit."""
    from safetensors.numpy import load_file

    hf_dir, _ = checkpoints["llama"]
    trainer, params = _import(hf_dir)
    hf.export_params(params, trainer.plan.model_config, str(tmp_path))
    original, exported = load_file(os.path.join(hf_dir, hf.SINGLE_FILE)), load_file(str(tmp_path / hf.SINGLE_FILE))
    assert sorted(original) == sorted(exported)
    for key in original:
        assert np.array_equal(original[key], exported[key]), key


def test_bf16_export_and_import_and_unprefixed_gpt2_names(checkpoints, tmp_path):
    """A bf16 export holds the bf16-rounded parameters and imports back as exactly those (upcast to fp32);
    GPT-2 checkpoints named without the `transformer.` prefix (the original OpenAI upload) import the same."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    hf_dir, _ = checkpoints["llama"]
    trainer, params = _import(hf_dir)
    hf.export_params(params, trainer.plan.model_config, str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, params16 = _import(str(tmp_path / "bf16"))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params16)):
        rounded = np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert b.dtype == jnp.float32 and np.array_equal(rounded, np.asarray(b)), jax.tree_util.keystr(path)

    gpt2_dir, _ = checkpoints["gpt2"]
    bare = tmp_path / "bare"
    shutil.copytree(gpt2_dir, bare)
    tensors = load_file(str(bare / hf.SINGLE_FILE))
    assert all(k.startswith("transformer.") for k in tensors), sorted(tensors)[:3]
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(bare / hf.SINGLE_FILE),
              metadata={"format": "pt"})
    _, ref = _import(gpt2_dir)
    _, got = _import(str(bare))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_import_onto_fsdp_tensor_mesh_is_sharded_by_the_rules_and_reads_only_slices(checkpoints, name):
    hf_dir, _ = checkpoints[name]
    ckpt = hf.Checkpoint(hf_dir)
    config = hf.import_config(ckpt, None, [("mesh.data", "1"), ("mesh.fsdp", "4"), ("mesh.tensor", "2")])
    trainer = Trainer(config, devices=jax.devices()[:8])
    reads = []
    params = hf.load_params(ckpt, trainer.plan.model_config, trainer.param_shardings,
                            on_read=lambda tensor, index: reads.append((tensor, index)))
    _, dense = _import(hf_dir)
    sources = ckpt.sources(trainer.plan.model_config)
    expected_elements, sharded = 0, 0
    only_sharded = {}  # HF tensor -> whether every parameter read from it is sharded
    for (keys, got), (_, want), ref in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                           jax.tree_util.tree_flatten_with_path(trainer.param_shardings)[0],
                                           jax.tree.leaves(dense)):
        path = hf._path(keys)
        assert got.sharding == want, (path, got.sharding.spec, want.spec)  # as the logical-axis rules say
        assert np.array_equal(np.asarray(got), np.asarray(ref)), path  # the same values as a 1-device import
        slices = {tuple((s.start, s.stop) for s in idx) for idx in want.devices_indices_map(got.shape).values()}
        expected_elements += len(slices) * int(np.prod(want.shard_shape(got.shape)))
        src = sources[path]
        sharded += not want.is_fully_replicated
        for i in range(got.shape[0] if src.stacked else 1):
            tensor = src.name.format(i=i)
            only_sharded[tensor] = only_sharded.get(tensor, True) and not want.is_fully_replicated
    assert sharded >= 8, "the mesh should shard most parameters"
    # Every distinct device slice is read once, and nothing else (no whole tensor read and then cut).
    assert sum(int(np.prod([s.stop - s.start for s in index])) for _, index in reads) == expected_elements
    for tensor, index in reads:
        full = int(np.prod(ckpt.slice(tensor).get_shape()))
        if only_sharded[tensor]:  # then no read covers it whole
            assert int(np.prod([s.stop - s.start for s in index])) < full, (tensor, index)


def test_bad_checkpoints_are_config_errors_naming_the_value(checkpoints, tmp_path):
    hf_dir, _ = checkpoints["llama"]
    with pytest.raises(ConfigError, match="--hf_dir=.*no such directory"):
        hf.Checkpoint(str(tmp_path / "missing"))
    bad = tmp_path / "unknown"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ConfigError, match="architecture 'NoSuchModelForCausalLM' is not supported"):
        hf.Checkpoint(str(bad))
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    ckpt = hf.Checkpoint(str(bad))
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight' has shape \(64, 32\) but config.json implies "
                                          r"\(96, 32\)"):
        hf.load_params(ckpt, hf.import_config(ckpt, None, []).model, {})


def _cli(script, *args):
    return run_launcher(script, *args, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)


@pytest.mark.slow
def test_cli_import_then_train_resumes_from_the_imported_weights(checkpoints, tmp_path):
    from parallax.defaults import load_config_file
    from parallax.train import make_dataset

    hf_dir, _ = checkpoints["llama"]
    work = str(tmp_path / "run")
    r = _cli("hf_import", f"--hf_dir={hf_dir}", f"--workdir={work}", "--cpu_devices=8", "--config.mesh.data=1",
             "--config.mesh.fsdp=4", "--config.mesh.tensor=2", "--config.train.steps=2", "--config.train.seq_len=32",
             "--config.train.log_every=1", "--config.train.eval_every=0")
    assert r.returncode == 0, r.stderr
    printed = r.stdout.split("train with: python launch/train.py ")[1].split()  # the command it prints, as is
    assert printed == [f"--config={work}/config.json", f"--workdir={work}", "--cpu_devices=8"], r.stdout
    r = _cli("train", *printed)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    losses = [r["loss"] for r in read_metrics(work)]
    assert len(losses) == 2
    # The first step's loss is the imported model's loss on batch 0 (computed here on one device).
    config = load_config_file(os.path.join(work, "config.json"))
    for axis in config.mesh:
        config.mesh[axis] = 1
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = hf.load_params(hf.Checkpoint(hf_dir), trainer.plan.model_config, trainer.param_shardings)
    loss, _ = trainer.loss_and_grads(params, trainer.device_batch(make_dataset(config).batch(0)))
    assert abs(losses[0] - float(loss)) <= 1e-5 * abs(float(loss)), (losses[0], float(loss))

    out = str(tmp_path / "exported")
    r = _cli("hf_export", f"--workdir={work}", f"--out={out}", "--cpu_devices=8")
    assert r.returncode == 0, r.stderr
    transformers.AutoModelForCausalLM.from_pretrained(out)  # the trained run loads in transformers

    r = _cli("hf_import", f"--hf_dir={tmp_path / 'missing'}", f"--workdir={tmp_path / 'run2'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"config error: --hf_dir={tmp_path / 'missing'}: no such directory; pass a directory holding config.json "
        "and model.safetensors (e.g. one written by save_pretrained)"]
    assert not os.path.exists(tmp_path / "run2")


def test_import_takes_the_hf_tokenizer_along_and_sampling_encodes_and_decodes_through_it(checkpoints, tmp_path):
    """A tokenizer written by transformers beside the tiny Llama: the import keeps it in WORKDIR/tokenizer, the
    prompt is encoded by it, the sample is decoded by it (checked against transformers' own), export writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from parallax.generate import generate
    from parallax.sample import sample_from_workdir

    hf_dir = str(tmp_path / "hf")
    shutil.copytree(checkpoints["llama"][0], hf_dir)
    rust = Tokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    rust.train_from_iterator(["the cat sat on the mat", "a dog ate the hat"] * 20, trainers.BpeTrainer(
        vocab_size=48, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(hf_dir)
    work = str(tmp_path / "run")
    hf.import_to_workdir(hf_dir, work, overrides=[("train.seq_len", "16")], devices=jax.devices()[:1],
                         log=lambda *_: None)
    prompt = "the cat"
    sample = sample_from_workdir(work, prompt, num_tokens=6, temperature=0)
    trainer, params = _import(hf_dir)
    ids = fast.encode(prompt, add_special_tokens=False)
    assert ids and max(ids) > 3  # real merges, not bytes
    out, = generate(trainer.graphdef, params, [ids], 6, 16, temperature=0, eos_id=fast.eos_token_id,
                    par=trainer.plan.parallelism)
    assert sample == f"step 0 sample:\n{prompt}{fast.decode(out.tolist(), skip_special_tokens=True)}", sample
    names = hf.export_workdir(work, str(tmp_path / "out"), devices=jax.devices()[:1], log=lambda *_: None)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(names)
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert again.encode(prompt, add_special_tokens=False) == ids
    # transformers' generation stops at the tokenizer's eos: both configs carry it (and bos only where the
    # tokenizer adds one); every file is as readable as any file this process writes
    model_config = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"))
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert model_config.eos_token_id == generation.eos_token_id == fast.eos_token_id
    mask = os.umask(0)
    os.umask(mask)
    for name in names:
        assert os.stat(tmp_path / "out" / name).st_mode & 0o777 == 0o666 & ~mask, name
