"""Gemma 2 and Gemma 3 text (models/gemma.py) against transformers, and across meshes.

Against transformers (tiny random models built offline, fp32, eager attention, random norm offsets):
Gemma 2 (2 layers: local then global; window 8; attention and final soft caps that bite; query_pre_attn_scalar
!= head_dim) and Gemma 3 (6 layers: 5 local, 1 global; QK-norm; RoPE 10k local / 1M global with linear scaling
8): imported logits on 40-token rows (past the window), the export round trip bitwise, and transformers'
greedy generation from the export past the window equal to parallax's KV-cache decode.
Training: Gemma 3's layers with a final soft cap and 4 layers alternating local / global (so every pipeline
stage holds both kinds) on data x fsdp, tensor and a 1f1b pipeline with tensor inside its stages, against
one device (loss, every gradient leaf, 3 steps, fp32 1e-5); bf16 train / eval / resume on one of those
meshes. The layer code is one for both families (Gemma 2 differs by its soft caps, config keys of the same
layer; the attention soft cap on every mesh is tests/test_window.py's), so Gemma 3's training stands for both.
"""
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import assert_parity, loss_grads_and_steps, rel_err, tiny_config  # noqa: E402
from parallax import hf  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402

TOL = 1e-5
WINDOW = 8
V = 64


def _gemma2_config(**changes):
    return transformers.Gemma2Config(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=5000.0, max_position_embeddings=64,
        initializer_range=0.2, attn_implementation="eager"), **changes})


def _gemma3_config(**changes):
    return transformers.Gemma3TextConfig(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        max_position_embeddings=64, initializer_range=0.2, attn_implementation="eager"), **changes})


MAKERS = {"gemma2": (transformers.Gemma2ForCausalLM, _gemma2_config),
          "gemma3": (transformers.Gemma3ForCausalLM, _gemma3_config)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (HF dir, the transformers model): tiny random models with random norm offsets."""
    out = {}
    for name, (cls, make) in MAKERS.items():
        torch.manual_seed(0)
        model = cls(make()).float().eval()
        with torch.no_grad():  # Gemma's norms hold offsets w (x * (1 + w)); random ones around 0
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.normal_(0.0, 0.3)
        path = str(tmp_path_factory.mktemp(f"hf_{name}"))
        model.save_pretrained(path)
        out[name] = (path, model)
    return out


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), use_cache=False).logits.float().numpy()


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_imported_logits_match_transformers_past_the_window(checkpoints, name):
    """Our import's logits equal transformers' (1e-5 relative) on 40-token rows; the window, the alternation and
    the soft caps each change transformers' logits far more than that (so the comparison can fail)."""
    from test_hf import _import, _our_logits

    hf_dir, model = checkpoints[name]
    trainer, params = _import(hf_dir)
    m = trainer.plan.model_config
    assert m.name == name and m.sliding_window == WINDOW and m.global_every == {"gemma2": 2, "gemma3": 6}[name]
    tokens = np.random.default_rng(0).integers(0, V, (2, 40)).astype(np.int32)
    ours, ref = _our_logits(trainer, params, tokens), _hf_logits(model, tokens)
    err = rel_err(ours, ref)
    print(f"{name}: logits rel error {err:.2e}, max abs {np.max(np.abs(ours - ref)):.2e} (std {ref.std():.2f})")
    assert ref.std() > 0.3
    assert err <= TOL
    layers = model.config.num_hidden_layers
    attentions = [layer.self_attn for layer in model.model.layers]
    changes = [("no window", [(model.config, "layer_types", ["full_attention"] * layers)]),
               ("every layer local", [(model.config, "layer_types", ["sliding_attention"] * layers)])]
    if name == "gemma2":  # the attention modules copy their soft cap from the config when built
        changes += [("no attention soft cap", [(a, "attn_logit_softcapping", None) for a in attentions]),
                    ("no final soft cap", [(model.config, "final_logit_softcapping", None)])]
    for what, sets in changes:
        old = [getattr(obj, key) for obj, key, _ in sets]
        for obj, key, value in sets:
            setattr(obj, key, value)
        try:
            moved = rel_err(_hf_logits(model, tokens), ref)
        finally:
            for (obj, key, _), value in zip(sets, old):
                setattr(obj, key, value)
        print(f"  {what}: logits move by {moved:.2e}")
        assert moved > 1e-3, what


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_export_roundtrips_bitwise_and_generates_as_transformers_past_the_window(checkpoints, name, tmp_path):
    """Export -> import is bitwise (the layer kinds come back from config.json's layer_types); transformers
    loads the export as the same architecture and its greedy generation (its own sliding-window cache) equals
    parallax's KV-cache decode token for token: 24 new tokens after prompts of 5 and 3."""
    from parallax.generate import generate
    from test_hf import _import

    hf_dir, model = checkpoints[name]
    trainer, params = _import(hf_dir)
    out = str(tmp_path / "export")
    hf.export_params(params, trainer.plan.model_config, out)
    _, again = _import(out)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == [type(model).__name__] and written["layer_types"] == model.config.layer_types
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert type(exported) is type(model)

    prompts, new = [[5, 17, 33, 2, 60], [41, 9, 12]], 24
    ours = generate(trainer.graphdef, params, prompts, new, 64, temperature=0, par=trainer.plan.parallelism)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = exported.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
        want = ids[0, len(prompt):].numpy()
        assert len(want) == new, want
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, change, match", [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    ("gemma2", dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
    ("gemma2", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.full_attention.rope_type='yarn'"),
    ("gemma3", dict(architectures=["Gemma3ForConditionalGeneration"]), "architectures=\\['Gemma3ForConditional"),
], ids=["activation", "untied", "pattern", "gemma3-softcap", "yarn", "vision"])
def test_unsupported_options_are_one_line_errors(name, change, match):
    from models.gemma import Gemma2, Gemma3

    cls, make = {"gemma2": (Gemma2, _gemma2_config), "gemma3": (Gemma3, _gemma3_config)}[name]
    config = {**make().to_dict(), "architectures": [cls.hf_architectures[0]], **change}
    with pytest.raises(ConfigError, match=f"^where: {match}.* is not supported by parallax's model; [^\n]*$"):
        cls.hf_model_keys(config, "where")


# ----------------------------------------------------------------------------------------------------
# Training: Gemma 3's layer (QK-norm, two RoPEs, alternating windows) with a final soft cap, across meshes

def _gemma(**mesh):
    """configs/tiny.py's shapes as a 4-layer Gemma 3 (local, global, local, global), window 8 in 8-token
    attention tiles, final soft cap 3: 32-token rows of documents of 9-29 tokens."""
    from parallax.model import model_config_defaults

    config = tiny_config(**mesh)
    model, gemma_keys = config.model, model_config_defaults("gemma3")
    with model.unlocked():
        for key in [k for k in model.keys() if k not in gemma_keys]:  # Llama's keys that Gemma has not
            del model[key]
        model.update(name="gemma3", num_layers=4, head_dim=16, sliding_window=WINDOW, global_every=2,
                     rope_theta=1000000.0, rope_local_theta=10000.0, rope_scale=8.0, final_softcap=3.0,
                     query_pre_attn_scalar=24, attention_block=8, norm_eps=1e-6)
    config.train.microbatches = 1
    config.pipeline.microbatches = 2
    return config


@pytest.fixture(scope="module")
def gemma_reference():
    """One device, the [T, T] reference attention (attention_block=0): loss, gradients and 3 steps."""
    config = _gemma()
    config.model.attention_block = 0
    return loss_grads_and_steps(config, jax.devices()[:1], steps=3)


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2), dict(pipe=2, tensor=2)], ids=["data-fsdp", "pipe-tensor"])
def test_gemma_trains_on_a_mesh_as_on_one_device(mesh, gemma_reference):
    """Loss, every gradient leaf and 3 steps at 1e-5 against one device: data x fsdp (the compiler's sharding,
    blockwise tiles) and a 1f1b pipeline with tensor (the manual region) inside its stages."""
    config = _gemma(**mesh)
    n = int(np.prod(list(mesh.values())))
    assert_parity(loss_grads_and_steps(config, jax.devices()[:n], steps=3), gemma_reference, TOL)


def test_gemma_layer_kinds_never_train_and_matter(gemma_reference):
    """The layer kinds get a zero gradient (so AdamW leaves them as they are), and they matter: with every
    layer global the attention weights' gradients differ by far more than the parity tolerance."""
    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    grads = gemma_reference[1]
    assert not np.any(np.asarray(grads["blocks"]["local"]))
    config = _gemma()
    config.model.update(attention_block=0, global_every=1)
    trainer = Trainer(config, devices=jax.devices()[:1])
    batch = trainer.device_batch(make_dataset(config).batch(0))
    _, other = trainer.loss_and_grads(trainer.init_state()["params"], batch)
    errs = {k: rel_err(other["blocks"][k], grads["blocks"][k]) for k in ("wq", "wk", "wv")}
    print("every layer global, gradient rel errors:", errs)
    assert min(errs.values()) > 1e-2, errs


def test_gemma_in_bf16_trains_evaluates_checkpoints_and_resumes(tmp_path):
    from helpers import bf16_train_eval_resume

    bf16_train_eval_resume(_gemma(data=2, fsdp=2, tensor=2), tmp_path)
