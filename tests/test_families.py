"""The dense families beside Llama: Llama 3.1 - 3.3 (llama3 RoPE scaling, a tied head) and Qwen 2.5 / Qwen 3
(`models/llama.py`'s decoder options, `models/qwen.py`).

Against transformers, per family, on a tiny random model built offline with its config class (random norm
scales, QK-norm scales and biases): the imported logits on 48 positions (past the llama3 scaling's
original context of 32), the export's tensors bit for bit, and transformers' greedy generation from the
export token for token against parallax's cached decode. Training on a pipeline with tensor and fsdp inside
the stages equals one device (loss, every gradient, steps), and for Qwen 2.5 also on tensor and on data x
fsdp; the Llama 3 options and Qwen 3 train, evaluate and resume in bf16; unsupported HF options are one line
each."""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF parity needs a CPU torch ('.[dev]')")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers ('.[dev]')")
pytest.importorskip("safetensors", reason="parallax.hf needs safetensors")

from helpers import (ROOT, assert_parity, bf16_train_eval_resume, loss_grads_and_steps, rel_err,  # noqa: E402
                     tiny_config)
from parallax import hf  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.generate import generate  # noqa: E402
from parallax.plan import make_plan  # noqa: E402
from test_hf import _hf_logits, _import, _our_logits, _randomize  # noqa: E402

TOL = 1e-5  # fp32: logits relative (Frobenius) error vs transformers; parity of loss, gradients and steps

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
# name -> (transformers model class, config class, config changes). head_dim 16 with theta 1e4 gives the
# llama3 rewrite all three kinds of frequency: wavelength 6.3 (< 32 / 4: kept), 19.9 (between: interpolated),
# 62.8 and up (> 32: divided by the factor).
FAMILIES = {
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(head_dim=16, rope_theta=1e4, rope_scaling=LLAMA3_ROPE)),
    "llama3.2": ("LlamaForCausalLM", "LlamaConfig", dict(
        tie_word_embeddings=True, rope_theta=5e5, rope_scaling={**LLAMA3_ROPE, "factor": 32.0, "high_freq_factor": 2.0})),
    "qwen2.5": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, rope_theta=1e6)),
}


def _make(path, name):
    model_cls, config_cls, changes = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=0.2), **changes})
    model = getattr(transformers, model_cls)(config).float().eval()
    _randomize(model, 1)  # norm, QK-norm scales and biases
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_logits_export_and_greedy_decode_match_transformers(tmp_path, name):
    from safetensors.numpy import load_file

    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "export")
    model = _make(hf_dir, name)
    trainer, params = _import(hf_dir)
    m = trainer.plan.model_config
    assert m.name == {"qwen2.5": "qwen2", "qwen3": "qwen3"}.get(name, "llama")
    tied = FAMILIES[name][2].get("tie_word_embeddings", False)
    assert m.tie_embeddings == tied and ("head" in params) != tied  # one table, not a copy
    # a config file of any of these families' models serves the others (the same keys), e.g. configs/dpo.py's
    assert hf.import_config(hf.Checkpoint(hf_dir), os.path.join(ROOT, "configs", "dpo.py"), []).model.name == m.name

    tokens = np.random.default_rng(0).integers(0, 64, (2, 48)).astype(np.int32)
    ours, ref = _our_logits(trainer, params, tokens), _hf_logits(model, tokens)
    err = rel_err(ours, ref)
    print(f"{name}: logits relative error {err:.2e} (max abs {np.abs(ours - ref).max():.2e}, std {ref.std():.2f})")
    assert ref.std() > 0.5 and err <= TOL

    hf.export_params(params, m, out)
    original, exported = load_file(os.path.join(hf_dir, hf.SINGLE_FILE)), load_file(os.path.join(out, hf.SINGLE_FILE))
    assert sorted(exported) == sorted(original) and ("lm_head.weight" in exported) != tied
    for key in original:
        assert np.array_equal(original[key], exported[key]), key
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["tie_word_embeddings"] == tied and config["architectures"] == [FAMILIES[name][0]]

    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt, new = [3, 17, 42, 5, 9, 60, 11, 28], 40  # decoding reaches position 47, past the original 32
    with torch.no_grad():
        want = again.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].numpy()
    got, = generate(trainer.graphdef, params, [prompt], new, 64, temperature=0, cache=True,
                    par=trainer.plan.parallelism)
    print(f"{name}: greedy {got.tolist()}")
    assert len(set(want.tolist())) >= 4  # not one repeated token: a wrong position shows
    np.testing.assert_array_equal(got, want)


# --- training: one device against the meshes, per family ----------------------------------------------------
# Llama 3.1 / 3.2 / 3.3 differ in sizes and in the tie only, so one Llama case has both (llama3 RoPE and a
# tied head); Qwen 2.5 runs its biases (untied: the tie's paths are the Llama case's), Qwen 3 its QK-norm.
# Each on a 1F1B pipeline with tensor and fsdp inside the stages (the tied table on the first and the last
# stage; every layer per tensor rank). Qwen 2.5, the family with new parameters (biases split over tensor
# with their heads), also on tensor x fsdp x data (the manual region) and on data x fsdp (the compiler's
# sharding): for Llama and Qwen 3 those paths add nothing a layer could break that the pipeline case does not
# run (the tied table gathered over fsdp for the loss: GPT-2's tensor x fsdp case, tests/test_models.py), and
# they run data x fsdp in bf16 below.
TRAIN = {
    "llama3": dict(name="llama", rope_scaling="llama3", rope_factor=8.0, rope_original_positions=16,
                   tie_embeddings=True),
    "qwen2": dict(name="qwen2"),
    "qwen3": dict(name="qwen3"),
}
TENSOR, PIPE, DATA = dict(tensor=2, fsdp=2, data=2), dict(pipe=2, tensor=2, fsdp=2), dict(data=4, fsdp=2)
CASES = [(f, PIPE) for f in TRAIN] + [("qwen2", TENSOR), ("qwen2", DATA)]


def _train_config(family, **mesh):
    config = tiny_config(**mesh)
    config.model.update(TRAIN[family], attention_block=0, loss_chunk=0)  # kernels and chunks: not what differs
    config.train.global_batch_size = 8
    config.pipeline.update(schedule="1f1b", microbatches=2)
    return config


def _ids(cases):
    return [f"{f}-" + ",".join(f"{k}={v}" for k, v in m.items()) for f, m in cases]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = loss_grads_and_steps(_train_config(family), jax.devices()[:1], steps=3)
            for path, g in jax.tree_util.tree_flatten_with_path(cache[family][1])[0]:  # every feature is trained
                assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)
        return cache[family]
    return get


@pytest.mark.parametrize("family,mesh", CASES, ids=_ids(CASES))
def test_family_trains_on_a_mesh_as_on_one_device(references, family, mesh):
    ref = references(family)
    names = set(ref[1]["blocks"])
    assert {"llama3": "head" not in ref[1], "qwen2": {"bq", "bk", "bv"} <= names,
            "qwen3": {"q_norm", "k_norm"} <= names}[family]
    assert_parity(loss_grads_and_steps(_train_config(family, **mesh), jax.devices(), steps=3), ref, TOL)


# bf16 where a family computes something new in it: the llama3 frequencies and the tied head (the table read
# in fp32 by the lookup, cast to bf16 for the head), and the QK-norm of bf16 q and k. (Qwen 2.5's biases are
# added in the compute dtype as GPT-2's, which tests/test_bf16.py runs in bf16; eval and resume do not depend
# on the family.)
BF16 = [("llama3", DATA), ("qwen3", DATA)]


@pytest.mark.parametrize("family,mesh", BF16, ids=_ids(BF16))
def test_family_trains_evaluates_and_resumes_in_bf16(tmp_path, family, mesh):
    bf16_train_eval_resume(_train_config(family, **mesh), tmp_path)


# --- what is refused ----------------------------------------------------------------------------------------

def _hf_config(name, **changes):
    model_cls, config_cls, base = FAMILIES[name]
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, **base).to_dict()
    return {**config, "architectures": [model_cls], **changes}


@pytest.mark.parametrize("name,changes,match", [
    ("llama3.1", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type='yarn'"),
    ("llama3.1", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    ("llama3.1", dict(attention_bias=True), "attention_bias=True"),
    ("llama3.2", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("qwen2.5", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen2.5", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types='sliding_attention'"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
], ids=["yarn", "dynamic", "llama-bias", "partial-rope", "qwen2-window", "qwen2-gelu", "qwen3-window", "qwen3-bias"])
def test_unsupported_hf_options_are_one_line_naming_the_field(name, changes, match):
    config = _hf_config(name, **changes)
    cls = hf.model_for(config, "config.json")[1]
    with pytest.raises(ConfigError, match=match) as info:
        cls.hf_model_keys(config, "--hf_dir=x/config.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("--hf_dir=x/config.json: ")


def test_linear_rope_scaling_reads_and_writes_its_factor():
    from models.llama import Llama
    keys = Llama.hf_model_keys(_hf_config("llama3.1", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e4}), "config.json")
    assert (keys["rope_scaling"], keys["rope_factor"], keys["rope_theta"]) == ("linear", 2.0, 1e4)
    llama31 = Llama.hf_model_keys(_hf_config("llama3.1"), "config.json")
    config = tiny_config()
    config.model.update(llama31)
    written = Llama.hf_config(config.model)["rope_parameters"]
    assert written == {**LLAMA3_ROPE, "rope_theta": 1e4}, written


def test_tied_head_refuses_the_vocabulary_parallel_pipeline_and_lora_skips_the_biases():
    config = _train_config("llama3", pipe=2, data=4)
    config.pipeline.vocab_parallel = True
    with pytest.raises(ConfigError, match="vocab_parallel=True: .*its head shares parameters with its embedding .*"
                                          "set pipeline.vocab_parallel=False") as info:
        make_plan(config, 8)
    assert "\n" not in str(info.value)
    config = _train_config("qwen2", tensor=2, data=4)
    config.lora.update(rank=4, targets="wq,wk,wv,wo")
    plan = make_plan(config, 8)
    assert sorted(t.name for t in plan.lora.targets) == ["wk", "wo", "wq", "wv"]
    assert plan.logical["blocks"]["bq"] == ("layers", "heads", "head_dim")  # split over tensor with wq's heads
    assert plan.logical["blocks"]["bk"] == ("layers", "kv_heads", "head_dim")
    config.lora.targets = "bq"
    with pytest.raises(ConfigError, match="matches bq, not a two-dim HF weight"):
        make_plan(config, 8)
