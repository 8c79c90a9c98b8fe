"""Mixtral and Qwen3-MoE through parallax's MoE model (models/mixtral.py, models/qwen3_moe.py): logits equal
transformers', export round trips bitwise in the Hub's per-expert layout and loads in transformers, greedy
generation with the KV cache equals transformers', and the imported model trains on expert / pipeline meshes
as on one device, and in bf16 with eval and a resume.

The checkpoints are tiny random transformers models built here (no downloads): 2 layers, d 32, 4 experts,
top-2, with random norm scales and a router scaled up so that routing is decisive (no near ties between the
k-th and (k+1)-th expert, which fp32 rounding could flip)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs a CPU torch (installed by '.[dev]' on Python < 3.12)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers ('.[dev]' on Python < 3.12)")
pytest.importorskip("safetensors", reason="parallax.hf needs safetensors")

from flax import nnx  # noqa: E402

from helpers import assert_parity, bf16_train_eval_resume, rel_err  # noqa: E402
from parallax import hf  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.generate import generate  # noqa: E402
from parallax.model import forward, model_class  # noqa: E402
from parallax.train import make_dataset  # noqa: E402
from parallax.trainer import Trainer  # noqa: E402

TOL = 1e-5  # relative (Frobenius) error of the logits against transformers', fp32
MESH_AXES = ("data", "fsdp", "pipe", "expert", "seq", "tensor")
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.2)


def _make(kind, path):
    """A random transformers model of `kind`, saved to `path` as save_pretrained writes it."""
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, sliding_window=None,
                                            rope_theta=5000.0)
        model = transformers.MixtralForCausalLM(config)
    else:  # head_dim 16 != d / heads (as Qwen3-30B-A3B: 128 != 64); the k gates not renormalised
        config = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=24, num_experts=4,
                                             head_dim=16, norm_topk_prob=False, rope_theta=5000.0)
        model = transformers.Qwen3MoeForCausalLM(config)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):  # the router: decisive choices
                p.mul_(5.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (HF dir, the transformers model)."""
    out = {}
    for kind in ("mixtral", "qwen3_moe"):
        path = str(tmp_path_factory.mktemp(f"hf_{kind}"))
        out[kind] = (path, _make(kind, path))
    return out


def _tokens(seed=0, shape=(2, 24)):
    return np.random.default_rng(seed).integers(0, 64, shape).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _overrides(**mesh):
    return [(f"mesh.{a}", str(mesh.get(a, 1))) for a in MESH_AXES] + [
        ("train.seq_len", "32"), ("train.global_batch_size", "16"), ("model.attention_block", "16"),
        ("model.loss_chunk", "8")]


def _import(hf_dir):
    """(trainer, params) of hf_dir on one device."""
    ckpt = hf.Checkpoint(hf_dir)
    trainer = Trainer(hf.import_config(ckpt, None, _overrides()), devices=jax.devices()[:1])
    return trainer, hf.load_params(ckpt, trainer.plan.model_config, trainer.param_shardings)


def _our_logits(trainer, params, tokens, moe=None):
    """fp32 logits [B, T, V]; `moe`: replace the blocks' routing settings (to show the test can fail)."""
    model = nnx.merge(trainer.graphdef, params)
    if moe:
        model.blocks.moe = dataclasses.replace(model.blocks.moe, **moe)
    B, T = tokens.shape
    batch = {"inputs": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T), (B, T)), "weights": jnp.ones((B, T), jnp.float32)}
    par = trainer.plan.parallelism
    return np.asarray(model.logits(forward(model, batch, par=par), par))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_imported_logits_match_transformers_fp32(checkpoints, kind):
    """The routing maps exactly: softmax over all experts, top-k, renormalised (Mixtral) or not (this Qwen3);
    flipping the renormalisation moves the logits far past the bound, so the bound can fail."""
    hf_dir, model = checkpoints[kind]
    trainer, params = _import(hf_dir)
    m = trainer.plan.model_config
    assert m.name == kind and m.moe.capacity_factor == 0 and m.moe.dispatch == "capacity"  # dropless: C = T
    assert m.qk_norm == (kind == "qwen3_moe") and m.moe.norm_topk == (kind == "mixtral")
    tokens = _tokens()
    ours, ref = _our_logits(trainer, params, tokens), _hf_logits(model, tokens)
    err = rel_err(ours, ref)
    flipped = rel_err(_our_logits(trainer, params, tokens, moe=dict(norm_topk=not m.moe.norm_topk)), ref)
    print(f"{kind}: logits rel err {err:.2e} (max abs {np.abs(ours - ref).max():.2e}, logits std {ref.std():.2f}); "
          f"norm_topk flipped: {flipped:.2e}")
    assert ref.std() > 0.5 and err <= TOL
    assert flipped > 1000 * TOL


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_export_is_the_hub_layout_bitwise_loads_in_transformers_and_generates_the_same_greedy_tokens(
        checkpoints, tmp_path, kind):
    """Export writes the checkpoint's own tensors (per-expert names, as the Hub's files) bit for bit; it imports
    back bitwise; transformers loads it with equal logits, and its greedy `generate` equals parallax's
    KV-cached generation token for token (two prompts of different lengths, batched on our side)."""
    from safetensors.numpy import load_file

    hf_dir, _ = checkpoints[kind]
    trainer, params = _import(hf_dir)
    out = str(tmp_path / "export")
    hf.export_params(params, trainer.plan.model_config, out)
    original, exported = load_file(os.path.join(hf_dir, hf.SINGLE_FILE)), load_file(os.path.join(out, hf.SINGLE_FILE))
    expert = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight",
              "qwen3_moe": "model.layers.1.mlp.experts.3.down_proj.weight"}[kind]
    assert expert in exported and sorted(original) == sorted(exported)
    for key in original:
        assert np.array_equal(original[key], exported[key]), key
    _, again = _import(out)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(loaded).__name__ == json.loads(open(os.path.join(out, "config.json")).read())["architectures"][0]
    tokens = _tokens(1)
    err = rel_err(_our_logits(trainer, params, tokens), _hf_logits(loaded, tokens))
    print(f"{kind}: the export in transformers vs ours: logits rel err {err:.2e}")
    assert err <= TOL

    prompts, new = [[5, 9, 17, 3, 44], [7, 1, 60]], 10
    eos = loaded.generation_config.eos_token_id
    ours = generate(trainer.graphdef, params, prompts, new, 32, temperature=0.0, eos_id=eos, cache=True,
                    par=trainer.plan.parallelism)
    print(f"{kind}: greedy tokens {[g.tolist() for g in ours]} (eos {eos})")
    assert sum(len(g) for g in ours) >= new  # not a trivial stop at eos
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = loaded.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        if eos is not None and eos in ref:  # ours ends before eos
            ref = ref[:ref.index(eos)]
        assert got.tolist() == ref, (prompt, got.tolist(), ref)


# --- training: one 1-device reference, shared by the mesh cases -------------------------------------------

def _imported_steps(hf_dir, devices, steps=3, **mesh):
    """(loss, grads) of batch 0 from the imported weights, then the losses of `steps` train steps."""
    ckpt = hf.Checkpoint(hf_dir)
    config = hf.import_config(ckpt, None, _overrides(**mesh))
    trainer, data = Trainer(config, devices=devices), make_dataset(config)
    params = hf.load_params(ckpt, trainer.plan.model_config, trainer.param_shardings)
    state = {**trainer.init_state(), "params": params}  # a fresh AdamW state (zeros) on the imported weights
    assert int(data.batch(0)["segment_ids"].max()) >= 2, "parity tests want several packed documents per row"
    loss, grads = jax.device_get(trainer.loss_and_grads(params, trainer.device_batch(data.batch(0))))
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(data.batch(step)))
        losses.append(float(metrics["loss"]))
    return float(loss), grads, losses


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Qwen3-MoE (QK-norm, gates not renormalised) on one device."""
    return _imported_steps(checkpoints["qwen3_moe"][0], jax.devices()[:1])


def test_reference_gradients_are_nonzero(reference):
    grads = reference[1]
    assert "router_bias" not in grads["blocks"] and {"q_norm", "k_norm"} <= set(grads["blocks"])
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("mesh", [
    dict(data=2, fsdp=2, expert=2),  # experts over expert ranks, the rest over data x fsdp
    dict(pipe=2, expert=2, tensor=2),  # a 1F1B pipeline with expert and tensor parallelism inside the stages
], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_imported_model_trains_on_a_mesh_as_on_one_device(checkpoints, reference, mesh):
    got = _imported_steps(checkpoints["qwen3_moe"][0], jax.devices(), **mesh)
    assert_parity(got, reference, TOL)


def test_imported_mixtral_bf16_trains_evaluates_checkpoints_and_resumes(checkpoints, tmp_path):
    """hf_import's path (a step-0 run in a workdir), then bf16 on expert x tensor x fsdp: eval and a
    checkpoint at step 2, a rerun resumes to 4."""
    from parallax.defaults import load_config_file

    work = tmp_path / "run"
    mesh = dict(expert=2, tensor=2, fsdp=2)
    hf.import_to_workdir(checkpoints["mixtral"][0], str(work), overrides=_overrides(**mesh) + [
        ("model.dtype", "bfloat16"), ("optim.decay_steps", "4")], devices=jax.devices(), log=lambda *_: None)
    config = load_config_file(str(work / "config.json"))
    assert config.model.name == "mixtral" and dict(config.mesh)["expert"] == 2
    bf16_train_eval_resume(config, work)


# --- what is refused, with one line -------------------------------------------------------------------------

@pytest.mark.parametrize("kind,change,match", [
    ("mixtral", dict(sliding_window=4096), "sliding_window=4096 is not supported"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
    ("mixtral", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type='yarn'"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is not supported"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), "use_sliding_window=True is not supported"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True is not supported"),
], ids=["mixtral-sliding_window", "mixtral-router_jitter_noise", "mixtral-rope_type", "qwen3_moe-decoder_sparse_step",
        "qwen3_moe-mlp_only_layers", "qwen3_moe-use_sliding_window", "qwen3_moe-attention_bias"])
def test_unsupported_hf_options_are_one_line_config_errors(checkpoints, kind, change, match):
    config = json.loads(open(os.path.join(checkpoints[kind][0], "config.json")).read())
    with pytest.raises(ConfigError, match=match) as info:
        model_class(kind).hf_model_keys({**config, **change}, "--hf_dir=x/config.json")
    assert "\n" not in str(info.value)


def test_routing_the_architecture_fixes_and_checkpoint_keys_cannot_be_overridden(checkpoints):
    ckpt = hf.Checkpoint(checkpoints["mixtral"][0])
    with pytest.raises(ConfigError, match=r"config.model.moe.top_k: set by the checkpoint's config.json \(2\)"):
        hf.import_config(ckpt, None, _overrides() + [("model.moe.top_k", "1")])
    config = hf.import_config(ckpt, None, _overrides())
    for key, value, match in [("router", "sigmoid", "moe.router='sigmoid': model 'mixtral' is MixtralForCausalLM"),
                              ("bias_rate", 0.01, "moe.bias_rate=0.01: model 'mixtral'")]:
        bad = hf.import_config(ckpt, None, _overrides())
        bad.model.moe[key] = value
        with pytest.raises(ConfigError, match=match) as info:
            Trainer(bad, devices=jax.devices()[:1])
        assert "\n" not in str(info.value)
    assert Trainer(config, devices=jax.devices()[:1]).plan.model_config.moe.router == "softmax"


@pytest.mark.parametrize("path,devices,params", [
    ("configs/mixtral_8x7b.py", 64, 46_702_792_704),  # transformers: MixtralForCausalLM(MixtralConfig()) on "meta"
    ("configs/qwen3_30b_a3b.py", 32, 30_532_122_624),  # the same of Qwen3-30B-A3B's config.json values
])
def test_real_size_configs_have_the_checkpoints_parameter_counts(path, devices, params):
    from helpers import ROOT
    from parallax.defaults import load_config_file
    from parallax.plan import make_plan

    plan = make_plan(load_config_file(os.path.join(ROOT, path)), devices)
    assert Trainer(plan, mesh=plan.abstract_mesh()).num_params == params
