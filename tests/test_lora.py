"""LoRA (`parallax/lora.py`): the forward equals peft's on the same adapter weights, the peft adapter
directory and the merged HF export load in peft / transformers with our logits, training on every mesh
equals one device (loss, every adapter gradient, steps) with the base bitwise frozen, eval / resume / bf16,
optimizer state and gradients for the adapters only, and the bad inputs (one line each).

The HF model is a tiny random Llama made with `transformers` (no download); adapters get random nonzero
A *and* B, so a wrong scale, transpose or factor order shows in the logits and the A gradients."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="peft parity needs a CPU torch ('.[dev]')")
transformers = pytest.importorskip("transformers", reason="peft parity needs transformers ('.[dev]')")
peft = pytest.importorskip("peft", reason="peft parity needs peft ('.[dev]')")

from flax import nnx  # noqa: E402

from helpers import assert_parity, rel_err, tiny_config, tiny_hf_llama  # noqa: E402
from parallax import hf, lora  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.model import forward  # noqa: E402
from parallax.train import make_dataset  # noqa: E402
from parallax.trainer import Trainer  # noqa: E402

ALL = "wq,wk,wv,wo,w_gate,w_up,w_down"
HF_TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"]
RANK, ALPHA = 4, 8.0
TOL = 1e-5  # fp32 logits: relative (Frobenius) error; the max abs error is printed beside it


def _randomize_adapters(trainer, params, seed=0, std=0.3):
    """`params` with every adapter (A and B) random and nonzero, placed as the trainer shards them."""
    rng = np.random.default_rng(seed)
    blocks = dict(params["blocks"])
    for name in blocks:
        if name.endswith((lora.SUFFIX_A, lora.SUFFIX_B)):
            value = std * rng.standard_normal(blocks[name].shape).astype(np.float32)
            blocks[name] = jax.device_put(value, trainer.param_shardings["blocks"][name])
    return {**params, "blocks": blocks}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """(HF dir, the transformers model): a tiny random Llama, fp32."""
    model = tiny_hf_llama(64, max_position_embeddings=64)
    path = str(tmp_path_factory.mktemp("hf_llama"))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def imported(hf_llama):
    """(trainer, params): the HF Llama imported with LoRA on every projection, adapters random."""
    ckpt = hf.Checkpoint(hf_llama[0])
    config = hf.import_config(ckpt, None, ())
    config.lora.update(rank=RANK, alpha=ALPHA, targets=ALL)
    trainer, params, _ = hf.load_checkpoint(ckpt, config, jax.devices()[:1], log=lambda *_: None)
    return trainer, _randomize_adapters(trainer, params)


def _tokens(seed=0, shape=(2, 24)):
    return np.random.default_rng(seed).integers(0, 64, shape).astype(np.int32)


def _our_logits(trainer, params, tokens):
    model = nnx.merge(trainer.graphdef, params)
    B, T = tokens.shape
    batch = {"inputs": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}
    return np.asarray(model.logits(forward(model, batch)))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_import_starts_adapters_from_init_and_the_base_from_the_checkpoint(hf_llama):
    """LoRA on an import: the base is the checkpoint's (logits of the HF model), B = 0 (so the same model)
    and A peft's kaiming-uniform bound."""
    ckpt = hf.Checkpoint(hf_llama[0])
    config = hf.import_config(ckpt, None, ())
    config.lora.update(rank=RANK, alpha=ALPHA, targets="wq,w_down")
    trainer, params, _ = hf.load_checkpoint(ckpt, config, jax.devices()[:1], log=lambda *_: None)
    blocks = params["blocks"]
    assert not np.any(np.asarray(blocks["wq_lora_b"])) and not np.any(np.asarray(blocks["w_down_lora_b"]))
    for name, fan_in in (("wq_lora_a", 32), ("w_down_lora_a", 64)):
        a = np.asarray(blocks[name])
        assert np.all(np.abs(a) <= 1 / np.sqrt(fan_in)) and a.std() > 0.3 / np.sqrt(fan_in)
    tokens = _tokens()
    assert np.max(np.abs(_our_logits(trainer, params, tokens) - _hf_logits(hf_llama[1], tokens))) <= 1e-4


def test_lora_forward_and_peft_directory_match_peft_fp32(hf_llama, imported, tmp_path):
    """The adapters exported as a peft directory load onto the HF base with peft (the keys and shapes peft
    itself writes) and give our logits: the same adapter weights, the same forward."""
    from safetensors.numpy import load_file

    trainer, params = imported
    out = str(tmp_path / "adapter")
    files = hf.export_peft(params, trainer.plan.model_config, trainer.plan.lora, out, base_model=hf_llama[0])
    assert sorted(files) == sorted([lora.PEFT_CONFIG, lora.PEFT_WEIGHTS])
    ours = load_file(os.path.join(out, lora.PEFT_WEIGHTS))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama[0]).float().eval()
    reference = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS))
    theirs = peft.get_peft_model_state_dict(reference)
    assert {k: tuple(v.shape) for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama[0]).float().eval()
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    assert json.load(open(os.path.join(out, lora.PEFT_CONFIG)))["target_modules"] == sorted(HF_TARGETS)
    tokens = _tokens(1)
    got, ref = _our_logits(trainer, params, tokens), _hf_logits(loaded, tokens)
    plain = _hf_logits(hf_llama[1], tokens)
    err = rel_err(got, ref)
    print(f"LoRA vs peft: logits rel err {err:.2e}, max abs {np.max(np.abs(got - ref)):.2e} (|logits| <= "
          f"{np.max(np.abs(ref)):.1f}); the adapters move the logits by {rel_err(plain, ref):.2f} (rel)")
    assert rel_err(plain, ref) > 0.1  # the adapters matter: the test can fail
    assert err <= TOL


def test_merged_export_loads_in_transformers_and_equals_peft_merge(hf_llama, imported, tmp_path):
    """The merged export (W + scale A B) is a plain HF checkpoint with our logits, and its weights are peft's
    merge_and_unload of the same adapters."""
    from safetensors.numpy import load_file

    trainer, params = imported
    adapter, out = str(tmp_path / "adapter"), str(tmp_path / "merged")
    hf.export_peft(params, trainer.plan.model_config, trainer.plan.lora, adapter)
    hf.export_params(lora.merged_params(params, trainer.plan.lora), trainer.plan.model_config, out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens = _tokens(2)
    err = rel_err(_hf_logits(exported, tokens), _our_logits(trainer, params, tokens))
    print(f"merged export in transformers vs ours: logits rel err {err:.2e}")
    assert err <= TOL
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_llama[0]).float().eval()
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()
    written = load_file(os.path.join(out, hf.SINGLE_FILE))
    worst = max(float(np.max(np.abs(written[k] - merged[k].numpy()))) for k in written)
    assert worst <= 1e-6, worst


# --- training on every mesh equals one device -------------------------------------------------------------

def _lora_config(**mesh):
    config = tiny_config(**mesh)
    config.lora.update(rank=RANK, alpha=ALPHA, targets=ALL)
    config.pipeline.update(schedule="1f1b", microbatches=4)
    config.optim.warmup_steps = 1
    return config


def _train(config, devices, steps=3):
    """(loss, gradients of the first batch, the step losses, params before, params after) from random
    nonzero adapters (so every A has a gradient), on `devices`."""
    trainer = Trainer(config, devices=devices)
    data = make_dataset(config)
    state = trainer.init_state()
    state = {**state, "params": _randomize_adapters(trainer, state["params"], std=0.05)}
    before = jax.device_get(state["params"])
    loss, grads = jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(data.batch(0))))
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(data.batch(step)))
        losses.append(float(metrics["loss"]))
    return float(loss), grads, losses, before, jax.device_get(state["params"])


def _adapters(tree):
    return {k: v for k, v in tree["blocks"].items() if k.endswith((lora.SUFFIX_A, lora.SUFFIX_B))}


@pytest.fixture(scope="module")
def reference():
    return _train(_lora_config(), jax.devices()[:1])


MESHES = {"data2-fsdp4": dict(data=2, fsdp=4), "data2-fsdp2-tensor2": dict(data=2, fsdp=2, tensor=2),
          "1f1b-pipe2-tensor2-fsdp2": dict(pipe=2, tensor=2, fsdp=2)}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_lora_training_on_a_mesh_matches_one_device_and_leaves_the_base_bitwise(reference, mesh):
    """Loss, every adapter's gradient and three steps' losses equal one device's (1e-5); every other
    parameter's gradient is exactly zero and its value bitwise unchanged by the steps. The FSDP case also
    accumulates two microbatches (no accumulator for the frozen leaves: `StepPath.loss_grads_aux`)."""
    config = _lora_config(**MESHES[mesh])
    if mesh == "data2-fsdp4":
        config.train.microbatches = 2
    loss, grads, losses, before, after = _train(config, jax.devices())
    ref_loss, ref_grads, ref_losses = reference[:3]
    assert all(np.any(g) for g in jax.tree.leaves(_adapters(ref_grads)))  # every A and B has a gradient
    assert_parity((loss, _adapters(grads), losses), (ref_loss, _adapters(ref_grads), ref_losses), 1e-5)
    for path, g in jax.tree_util.tree_flatten_with_path(lora.without_adapters(grads))[0]:
        assert not np.any(g), jax.tree_util.keystr(path)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(lora.without_adapters(before))[0],
                            jax.tree.leaves(lora.without_adapters(after))):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)
    assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(_adapters(before)),
                                                         jax.tree.leaves(_adapters(after))))


# --- runs: eval, checkpoints, exports, bf16 -----------------------------------------------------------------

PIPE = MESHES["1f1b-pipe2-tensor2-fsdp2"]


def _run_config(steps, **mesh):
    config = _lora_config(**mesh)
    config.train.update(steps=steps, eval_every=2, checkpoint_every=2, log_every=1)
    config.optim.decay_steps = 4
    return config


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'straight': 4 steps, 'resumed': 2 steps then resumed to 4}: LoRA runs on the pipeline mesh."""
    from parallax.train import train_and_evaluate

    root = tmp_path_factory.mktemp("lora_runs")
    straight = train_and_evaluate(_run_config(4, **PIPE), str(root / "straight"), log=_quiet)
    train_and_evaluate(_run_config(2, **PIPE), str(root / "resumed"), log=_quiet)
    resumed = train_and_evaluate(_run_config(4, **PIPE), str(root / "resumed"), log=_quiet)
    return {"straight": (str(root / "straight"), straight), "resumed": (str(root / "resumed"), resumed)}


def test_lora_resume_is_bitwise_and_the_optimizer_holds_adapters_only(runs):
    (_, straight), (_, resumed) = runs["straight"], runs["resumed"]
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history][2:]
    assert np.isfinite(straight.eval_loss) and straight.eval_loss == resumed.eval_loss
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(straight.state)[0], jax.tree.leaves(resumed.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    # optimizer state: Adam's two moments of each adapter, and scalar counts; nothing of the base
    sized = [(jax.tree_util.keystr(p), a.shape) for p, a in jax.tree_util.tree_flatten_with_path(
        straight.state["opt_state"])[0] if a.ndim]
    adapters = _adapters(straight.state["params"])
    assert sorted(s for _, s in sized) == sorted(2 * [a.shape for a in adapters.values()])
    assert all(any(f"'{name}'" in path for name in adapters) for path, _ in sized)


def test_trained_lora_run_exports_merged_and_as_a_peft_directory(runs, tmp_path):
    """From a trained LoRA run's workdir: the merged export in transformers and the peft directory on the
    base's export in peft give the same logits (and ours)."""
    workdir, result = runs["straight"]
    params, trainer = result.state["params"], result.trainer
    merged, adapter, base = (str(tmp_path / n) for n in ("merged", "adapter", "base"))
    assert hf.export_workdir(workdir, merged, log=_quiet) == [hf.SINGLE_FILE, "config.json"]
    hf.export_workdir(workdir, adapter, peft=True, base_model=base, log=_quiet)
    hf.export_params(lora.without_adapters(params), trainer.plan.model_config, base)
    tokens = _tokens(3, (2, 32))
    with_peft = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base).float().eval(), adapter).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged).float().eval()
    one = jax.device_get(params)
    ours = _our_logits(Trainer(_lora_config(), devices=jax.devices()[:1]), one, tokens)
    err_peft, err_merged = rel_err(_hf_logits(with_peft, tokens), ours), rel_err(_hf_logits(plain, tokens), ours)
    print(f"trained run: peft directory {err_peft:.2e}, merged export {err_merged:.2e} (logits rel err vs ours)")
    assert err_peft <= TOL and err_merged <= TOL
    assert json.load(open(os.path.join(adapter, lora.PEFT_CONFIG)))["base_model_name_or_path"] == base


def test_lora_runs_in_bf16_with_eval_and_resume(tmp_path):
    from helpers import bf16_train_eval_resume

    bf16_train_eval_resume(_lora_config(**PIPE), tmp_path)


# --- bad inputs: one line naming the key and the fix, nothing written -------------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("targets", "wq,wx", r"config.lora.targets='wq,wx': 'wx' matches no weight of the layer stack \(its weights: "
                         r"attn_norm, .*\); name some of"),
    ("targets", "wq,.*norm", r"'.\*norm' matches attn_norm, not a two-dim HF weight; adapters go on"),
    ("dropout", 0.1, r"config.lora.dropout=0.1: not implemented; .* set lora.dropout=0"),
    ("alpha", 0.0, r"config.lora.alpha=0.0: must be > 0"),
])
def test_bad_lora_settings_are_one_line_errors(key, value, match):
    from parallax.plan import make_plan

    config = _lora_config()
    config.lora[key] = value
    with pytest.raises(ConfigError, match=match) as e:
        make_plan(config, 1)
    assert "\n" not in str(e.value)


def test_lora_on_gpt2_refuses_its_fused_qkv_and_takes_its_conv1d_weights():
    from parallax.plan import make_plan

    config = tiny_config("gpt2")
    config.lora.update(rank=2, targets="wq")
    with pytest.raises(ConfigError, match=r"'wq' matches wq, a part of the fused HF tensor "
                                          r"transformer.h.\{i\}.attn.c_attn.weight"):
        make_plan(config, 1)
    config.lora.targets = "wo,w_fc"
    targets = make_plan(config, 1).lora.targets
    assert [(t.name, t.in_dims, t.module) for t in targets] == [("w_fc", (0,), "mlp.c_fc"),
                                                                ("wo", (0, 1), "attn.c_proj")]


def test_a_lora_checkpoint_resumed_without_lora_is_one_line_and_writes_nothing(runs):
    from parallax.train import train_and_evaluate

    workdir, _ = runs["resumed"]
    before = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(workdir) for p in files}
    config = _run_config(6, **PIPE)
    config.lora.rank = 0
    with pytest.raises(ConfigError, match=r"config.lora.rank=0: the checkpoint in this workdir holds LoRA adapters "
                                          r"\(lora.rank=4, .*resume with --config.lora.rank=4") as e:
        train_and_evaluate(config, workdir, log=_quiet)
    assert "\n" not in str(e.value)
    config.lora.update(rank=4, targets="wq")
    with pytest.raises(ConfigError, match=r"config.lora.targets='wq': .* trained with lora.targets="):
        train_and_evaluate(config, workdir, log=_quiet)
    after = {p: os.stat(os.path.join(d, p)).st_mtime_ns for d, _, files in os.walk(workdir) for p in files}
    assert after == before


def test_lora_gradients_equal_peft_backward_fp32(hf_llama, imported, tmp_path):
    """The adapters' gradients of the mean next-token loss equal torch's through peft (ours mapped to peft's
    layout by `peft_factors`, a linear map): the custom VJP of the merged weight against autograd. The
    reference runs in float64: torch's own fp32 gradients are 5.3e-6 from it and ours 8.2e-6 (2026-12-07), so
    two fp32 runs compared with each other sum both roundings (1.28e-5) and test neither."""
    trainer, params = imported
    out = str(tmp_path / "adapter")
    hf.export_peft(params, trainer.plan.model_config, trainer.plan.lora, out)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_llama[0]).double(),
                                           out, is_trainable=True).double()
    tokens = _tokens(4, (2, 25))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(torch.tensor(inputs, dtype=torch.long)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(targets.reshape(-1), dtype=torch.long)).backward()
    theirs = {n.replace(".default", ""): p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    B, T = inputs.shape
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets), "weights": jnp.ones((B, T)),
             "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}
    _, grads = jax.device_get(trainer.loss_and_grads(params, batch))
    worst = 0.0
    for t in trainer.plan.lora.targets:
        ga, gb = lora.peft_factors(t, grads["blocks"][t.name + lora.SUFFIX_A], grads["blocks"][t.name + lora.SUFFIX_B])
        for i in range(ga.shape[0]):
            name = "base_model.model." + t.source.name.format(i=i).rsplit(".weight", 1)[0]
            worst = max(worst, rel_err(ga[i], theirs[f"{name}.lora_A.weight"]),
                        rel_err(gb[i], theirs[f"{name}.lora_B.weight"]))
    assert len(theirs) == 2 * 2 * len(trainer.plan.lora.targets)  # only the adapters have gradients in peft
    print(f"adapter gradients vs peft's backward: worst rel err {worst:.2e}")
    assert worst <= TOL


def test_lora_with_muon_keeps_state_for_the_adapters_only():
    """Muon's own partition (matrices / AdamW) inside LoRA's frozen one: the adapters move, nothing else."""
    config = _lora_config()
    config.lora.targets = "wq,w_down"
    config.optim.name = "muon"
    trainer = Trainer(config, devices=jax.devices()[:1])
    data = make_dataset(config)
    state = trainer.init_state()
    before = jax.device_get(state["params"])
    for step in range(2):
        state, _ = trainer.train_step(state, trainer.device_batch(data.batch(step)))
    after = jax.device_get(state["params"])
    moved = {jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                                                          jax.tree.leaves(after)) if not np.array_equal(a, b)}
    assert moved == {f"['blocks']['{n}']" for n in _adapters(before)}
    assert all(a.ndim == 0 or a.shape in {v.shape for v in _adapters(before).values()}
               for a in jax.tree.leaves(state["opt_state"]))
