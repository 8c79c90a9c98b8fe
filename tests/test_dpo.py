"""DPO (`parallax/steps/dpo.py`, `parallax/preference.py`): TRL's DPOTrainer loss and metrics at step 0 on a
tiny Llama (sigmoid and IPO, plain-text and conversational pairs), the two-pass gradient against a by-hand
`jax.grad` of the DPO loss, the same loss, gradients and steps on data x FSDP, tensor and a pipeline with
tensor and FSDP inside its stages as on one device (one shared reference), a run that evaluates,
logs TRL's metrics, resumes bitwise and trains in bf16, and bad pair files as one line that writes nothing."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import byte_level_bpe, max_leaf_rel_err, read_metrics, rel_err, tiny_config, tiny_hf_llama
from parallax import model as model_lib
from parallax import preference
from parallax.errors import ConfigError
from parallax.steps import dpo
from parallax.trainer import Trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


# --- synthetic pairs: the mesh tests -------------------------------------------------------------------

def _pairs(n, vocab, seed=0):
    rng = np.random.default_rng(seed)

    def ids(k):
        return tuple(int(x) for x in rng.integers(1, vocab, k))
    return [preference.Pair(ids(int(rng.integers(2, 6))), ids(int(rng.integers(2, 7))), ids(int(rng.integers(2, 7))))
            for _ in range(n)]


class _Tok:
    def describe(self):
        return "synthetic ids"


def _dataset(config, n=24, eval_fraction=0.25):
    t = config.train
    return preference.PreferenceDataset("synthetic", _pairs(n, config.model.vocab_size), 0, t.seq_len,
                                        t.global_batch_size, t.seed, eval_fraction, "epoch", _Tok())


def _config(loss_type="sigmoid", **mesh):
    config = tiny_config(**mesh)
    config.data.source = "preference"
    config.dpo.loss_type = loss_type
    config.dpo.beta = 0.5
    config.train.update(global_batch_size=8, seq_len=32)
    config.optim.lr = 3e-3
    return config


def _with_reference(config, dataset, seed=1):
    """`dataset` with its reference from a model other than the policy (else every reward starts at 0)."""
    trainer = Trainer(config, devices=jax.devices()[:1])
    from parallax.train import reference_logps
    ref_params = trainer.init_state(seed)["params"]
    for split in preference.SPLITS:
        dataset.set_reference(split, reference_logps(trainer, dataset, ref_params, split))
    return dataset


@pytest.fixture(scope="module")
def shared():
    """One reference (on one device) for every mesh: (dataset, single-device loss / grads / step losses)."""
    config = _config()
    dataset = _with_reference(config, _dataset(config))
    return dataset, _loss_grads_steps(config, dataset, jax.devices()[:1])


def _loss_grads_steps(config, dataset, devices, steps=3):
    trainer = Trainer(config, devices=devices)
    state = trainer.init_state()
    loss, grads = jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(dataset.batch(0))))
    losses, records = [], []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(step)))
        losses.append(float(metrics["loss"]))
        records.append({k: float(v) for k, v in jax.device_get(metrics["path"]).items()})
    return float(loss), grads, losses, records


def _by_hand(config, dataset, params, batch):
    """The DPO loss of `batch` written directly: logits, log-softmax, masked sums, TRL's formula; its jax.grad."""
    trainer = Trainer(config, devices=jax.devices()[:1])
    beta = config.dpo.beta

    def loss_fn(p):
        model = nnx.merge(trainer.plan.graphdef, p)
        logits = model.logits(model_lib.forward(model, batch)).astype(jnp.float32)  # (B, T, V)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
        chosen = (batch["sign"] > 0) * batch["weights"]
        rejected = (batch["sign"] < 0) * batch["weights"]
        lc, lr = jnp.sum(logp * chosen, 1), jnp.sum(logp * rejected, 1)
        rc, rr = jnp.sum(batch["ref_logps"] * chosen, 1), jnp.sum(batch["ref_logps"] * rejected, 1)
        if config.dpo.loss_type == "sigmoid":
            return jnp.mean(-jax.nn.log_sigmoid(beta * ((lc - rc) - (lr - rr))))
        delta = (lc - rc) / jnp.sum(chosen, 1) - (lr - rr) / jnp.sum(rejected, 1)
        return jnp.mean((delta - 1 / (2 * beta)) ** 2)
    return jax.value_and_grad(loss_fn)(params)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_two_pass_gradient_equals_jax_grad_of_the_dpo_loss_on_one_device(loss_type):
    config = _config(loss_type)
    config.train.microbatches = 2  # both passes accumulate over microbatches
    dataset = _with_reference(config, _dataset(config))
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = trainer.init_state()["params"]
    host = dataset.batch(0)
    loss, grads = jax.device_get(trainer.loss_and_grads(params, trainer.device_batch(host)))
    ref_loss, ref_grads = jax.device_get(_by_hand(config, dataset, params, {k: jnp.asarray(v) for k, v in host.items()}))
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{loss_type}: loss {loss:.6f} vs {ref_loss:.6f}; worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= 1e-6 and err <= 1e-5
    assert abs(loss - np.log(2)) > 1e-3 if loss_type == "sigmoid" else True  # the reference differs


@pytest.mark.parametrize("mesh", [
    # (data x fsdp: the LoRA case below and the run test, on data 2 x fsdp 2)
    dict(data=2, tensor=2, fsdp=2),
    dict(pipe=2, tensor=2, fsdp=2),
], ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_dpo_on_a_mesh_equals_one_device(shared, mesh):
    dataset, (ref_loss, ref_grads, ref_losses, ref_records) = shared
    config = _config(**mesh)
    if mesh.get("pipe", 1) > 1:
        config.pipeline.update(schedule="1f1b", microbatches=2)
    loss, grads, losses, records = _loss_grads_steps(config, dataset, jax.devices())
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{mesh}: loss rel err {rel_err(loss, ref_loss):.2e}, worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= 1e-5 and err <= 1e-5, where
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(records, ref_records):
        for k in METRICS:
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), k


def test_dpo_with_lora_has_the_base_as_its_reference_and_trains_only_the_adapters_on_a_mesh():
    """DPO + LoRA: the reference pass runs the starting model, which is the base (B = 0), so step 0's rewards
    are all 0; the adapters' gradients are a by-hand jax.grad's (on one device), and on data 2 x fsdp 2 the
    loss, every gradient and three steps equal one device's, with the base bitwise unchanged."""
    from parallax import lora as lora_lib
    from parallax.train import reference_logps

    config = _config()
    config.lora.update(rank=2, alpha=4.0, targets="wq,wv,w_down")
    dataset = _dataset(config)
    trainer = Trainer(config, devices=jax.devices()[:1])
    start = trainer.init_state()["params"]
    for split in preference.SPLITS:
        dataset.set_reference(split, reference_logps(trainer, dataset, start, split))
    host = dataset.batch(0)
    _, by_hand = jax.device_get(_by_hand(config, dataset, start, {k: jnp.asarray(v) for k, v in host.items()}))
    loss, grads, losses, records = _loss_grads_steps(config, dataset, jax.devices()[:1])
    assert abs(loss - np.log(2)) < 1e-6 and all(abs(records[0][k]) < 1e-6 for k in ("rewards/chosen",
                                                                                 "rewards/margins"))
    flat, ref = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (grads, by_hand))
    adapters = [k for k in flat if str(k[-1]).strip("'[]").endswith((lora_lib.SUFFIX_A, lora_lib.SUFFIX_B))]
    assert len(adapters) == 6
    for k in adapters:
        assert rel_err(flat[k], ref[k]) <= 1e-5, k
    assert any(np.abs(flat[k]).max() > 0 for k in adapters)
    mesh_config = _config(data=2, fsdp=2)
    mesh_config.lora.update(rank=2, alpha=4.0, targets="wq,wv,w_down")
    mesh_loss, mesh_grads, mesh_losses, _ = _loss_grads_steps(mesh_config, dataset, jax.devices()[:4])
    err, where = max_leaf_rel_err(mesh_grads, grads)
    assert rel_err(mesh_loss, loss) <= 1e-5 and err <= 1e-5, where
    np.testing.assert_allclose(mesh_losses, losses, rtol=1e-5)
    trained = Trainer(mesh_config, devices=jax.devices()[:4])
    state = trained.init_state()
    for step in range(2):
        state, _ = trained.train_step(state, trained.device_batch(dataset.batch(step)))
    after = dict(jax.tree_util.tree_leaves_with_path(jax.device_get(state["params"])))
    before = dict(jax.tree_util.tree_leaves_with_path(jax.device_get(start)))
    for k, v in before.items():
        if k not in adapters:
            np.testing.assert_array_equal(after[k], v, err_msg=str(k))


# --- TRL's DPOTrainer at step 0 ------------------------------------------------------------------------

def _hf_libraries():
    """(transformers, trl), or the test skipped (the Python 3.12 leg has neither; the tests above run there)."""
    return (pytest.importorskip("transformers", reason="TRL parity needs transformers ('.[dev]')"),
            pytest.importorskip("trl", reason="TRL parity needs trl ('.[dev]')"))

CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """(policy dir, reference dir, transformers tokenizer): two tiny Llamas (other seeds) sharing a byte-level
    BPE with ChatML's tokens and Qwen 2.5's chat template (the file TRL ships)."""
    transformers, trl = _hf_libraries()
    pytest.importorskip("torch")
    words = ["Hello, how are you today? I am fine, thank you very much.", "What is the capital of France? Paris."]
    rust = byte_level_bpe(words * 20, 360, CHATML)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as f:
        fast.chat_template = f.read()
    dirs = []
    for name, seed in (("policy", 0), ("reference", 1)):
        path = str(tmp_path_factory.mktemp(name))
        fast.save_pretrained(path)
        tiny_hf_llama(384, seed).save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1], fast


def _rows(kind):
    if kind == "text":
        return [{"prompt": f"Hello {i}, how are you?", "chosen": f" I am fine {i}, thank you.",
                 "rejected": " What is the capital" + " of France" * (i % 3)} for i in range(4)]
    return [{"prompt": [{"role": "user", "content": f"Hello {i}, how are you?"}],
             "chosen": [{"role": "assistant", "content": f"I am fine {i}, thank you."}],
             "rejected": [{"role": "assistant", "content": "Paris." * (1 + i % 2)}]} for i in range(4)]


@pytest.mark.parametrize("loss_type,kind,max_length", [("sigmoid", "text", None), ("ipo", "chat", None),
                                                       ("sigmoid", "text", 14)])
def test_loss_and_metrics_at_step_0_equal_trl_dpo_trainer(hf_models, tmp_path, loss_type, kind, max_length):
    """TRL's DPOTrainer (its own reference model) on 4 pairs: its loss and metrics on its collated batch;
    parallax imports both models, prepares the same file, computes the reference's sums by its reference pass
    and takes the step-0 loss and metrics: the same ids, and equal at fp32 1e-5."""
    transformers, trl = _hf_libraries()
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    from parallax import hf
    from parallax import tokenizer as tok_lib
    from parallax.train import make_dataset, reference_logps

    policy_dir, reference_dir, fast = hf_models
    rows, beta = _rows(kind), 0.5
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type], max_length=max_length,
                         per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False)  # fp32 throughout
    load = transformers.LlamaForCausalLM.from_pretrained
    trainer = trl.DPOTrainer(model=load(policy_dir).float(), ref_model=load(reference_dir).float(), args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=fast)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    with torch.no_grad():
        trl_loss = float(trainer.compute_loss(trainer.model, trainer.data_collator(examples)))
    trl_metrics = {k: v[-1] for mode in trainer._metrics.values() for k, v in mode.items() if v}

    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    overrides = [("data.source", "preference"), ("data.path", str(path)), ("data.tokenizer", policy_dir),
                 ("data.eval_fraction", "0.0"), ("data.sampler", "epoch"), ("train.eval_every", "0"),
                 ("train.seq_len", "256"),
                 ("train.global_batch_size", "4"), ("dpo.loss_type", loss_type), ("dpo.beta", str(beta)),
                 ("dpo.max_length", str(max_length or 0))]
    config = hf.import_config(hf.Checkpoint(policy_dir), None, overrides)
    ours = Trainer(config, devices=jax.devices()[:1])
    dataset = make_dataset(config, tok_lib.load(policy_dir))
    assert len(dataset.pairs["train"]) == len(examples) == len(rows)
    for pair, example in zip(dataset.pairs["train"], examples):  # TRL's ids, cut as TRL cuts them
        cut = slice(None, max_length)
        assert list(pair.prompt + pair.chosen) == (example["prompt_ids"] + example["chosen_ids"])[cut]
        assert list(pair.prompt + pair.rejected) == (example["prompt_ids"] + example["rejected_ids"])[cut]
    params = hf.load_params(hf.Checkpoint(policy_dir), ours.plan.model_config, ours.param_shardings)
    ref_params = hf.load_params(hf.Checkpoint(reference_dir), ours.plan.model_config, ours.param_shardings)
    dataset.set_reference("train", reference_logps(ours, dataset, ref_params, "train"))
    batch = ours.device_batch(dataset.batch(0))  # (the epoch sampler's order: the mean is over the same 4)
    loss, _, _, metrics = jax.device_get(jax.jit(lambda p, b: dpo.loss_grads_metrics(ours.path, p, b))(params, batch))
    print(f"{loss_type} {kind}: parallax {float(loss):.7f}, TRL {trl_loss:.7f}")
    for k in METRICS:
        print(f"  {k}: {float(metrics[k]):.7f} {trl_metrics[k]:.7f}")
    assert abs(float(loss) - trl_loss) <= 1e-5 * max(1.0, abs(trl_loss))
    for k in METRICS:
        assert abs(float(metrics[k]) - trl_metrics[k]) <= 1e-5 * max(1.0, abs(trl_metrics[k])), k
    assert trl_metrics["rewards/margins"] != 0.0  # the reference is another model: rewards are not all 0


# --- a run: eval, metrics, resume, bf16 ------------------------------------------------------------------

def _file_config(tmp_path, tok_dir, n=8, **rows):
    path = tmp_path / "pairs.jsonl"
    pairs = [{"prompt": f"Hello {i}, how are you?", "chosen": f" I am fine {i}, thank you.",
              "rejected": " What is the capital" + " of France" * (i % 3)} for i in range(n)]
    path.write_text("\n".join(json.dumps({**p, **rows}) for p in pairs) + "\n")
    config = _config()
    config.model.vocab_size = 384
    config.data.update(path=str(path), tokenizer=tok_dir, eval_fraction=0.25, sampler="epoch")
    config.train.update(global_batch_size=4, seq_len=64, steps=4, eval_every=2, eval_batches=1,
                        checkpoint_every=2, log_every=1, async_checkpoint=False)
    config.optim.decay_steps = 4  # a run of 2 steps resumes to 4 on the same schedule
    return config


def test_a_dpo_run_logs_trl_metrics_evaluates_and_resumes_bitwise(hf_models, tmp_path):
    from parallax.summary import read_scalars
    from parallax.train import REFERENCE_FILE, train_and_evaluate

    config = _file_config(tmp_path, hf_models[0])
    config.mesh.update(data=2, fsdp=2)
    whole = train_and_evaluate(config, str(tmp_path / "whole"), devices=jax.devices()[:4], log=lambda *_: None)
    records = read_metrics(tmp_path / "whole")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert all(np.isfinite(r[k]) for k in ("loss", *METRICS)) and abs(r["rewards/chosen"]) < 10
    assert abs(records[0]["rewards/margins"]) < 1e-5  # step 1's policy is the reference: every reward 0
    assert records[-1]["rewards/margins"] > 0 and records[-1]["loss"] < np.log(2)  # it learns its preferences
    assert all(np.isfinite(r["eval_loss"]) for r in records if r["step"] in (2, 4))
    scalars = read_scalars(str(tmp_path / "whole" / "tb"))
    assert [s for s, _ in scalars["rewards/accuracies"]] == [1, 2, 3, 4] and "eval_loss" in scalars
    assert (tmp_path / "whole" / REFERENCE_FILE).exists()

    config.train.steps = 2
    train_and_evaluate(config, str(tmp_path / "resumed"), devices=jax.devices()[:4], log=lambda *_: None)
    config.train.steps = 4
    resumed = train_and_evaluate(config, str(tmp_path / "resumed"), devices=jax.devices()[:4], log=lambda *_: None)
    assert [r["step"] for r in resumed.history] == [3, 4]
    for a, b in zip(jax.tree.leaves(jax.device_get(whole.state["params"])),
                    jax.tree.leaves(jax.device_get(resumed.state["params"]))):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == [r["loss"] for r in records]


def test_dpo_trains_in_bf16(hf_models, tmp_path):
    from parallax.train import train_and_evaluate

    config = _file_config(tmp_path, hf_models[0])
    config.model.dtype = "bfloat16"
    config.train.steps = 2
    result = train_and_evaluate(config, str(tmp_path / "run"), devices=jax.devices()[:1], log=lambda *_: None)
    records = read_metrics(tmp_path / "run")
    assert all(np.isfinite(r[k]) for r in records for k in ("loss", *METRICS))
    assert np.isfinite(result.eval_loss) and 0 < result.eval_loss < 2


# --- bad inputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("line,expected", [
    ({"prompt": "Hi", "chosen": " Paris.", "rejected": " Paris."}, "pairs.jsonl:3: 'chosen' equals 'rejected'"),
    ({"prompt": "Hi", "chosen": " Paris."}, "pairs.jsonl:3: no 'rejected' (a preference row has 'prompt', 'chosen'"),
    ({"chosen": " Paris.", "rejected": " Rome."}, "pairs.jsonl:3: no 'prompt'"),
    ({"prompt": "Hi", "chosen": [{"role": "assistant", "content": "x"}], "rejected": " Rome."},
     "pairs.jsonl:3: 'prompt', 'chosen' and 'rejected' must be three strings or three lists of messages"),
    ({"prompt": "", "chosen": " Paris.", "rejected": " Rome."}, "pairs.jsonl:3: the prompt is empty"),
    ({"prompt": "Hi " * 40, "chosen": " Paris.", "rejected": " Rome."},
     "pairs.jsonl:3: the pair takes 250 tokens"),
    ("not json", "pairs.jsonl:3: not a JSON object"),
], ids=["chosen_equals_rejected", "no_rejected", "no_prompt", "mixed_kinds", "empty_prompt", "too_long", "not_json"])
def test_bad_pairs_are_one_line_naming_file_line_and_fix_and_write_nothing(hf_models, tmp_path, line, expected):
    from parallax.train import train_and_evaluate

    config = _file_config(tmp_path, hf_models[0], n=4)
    path = tmp_path / "pairs.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(2, line if isinstance(line, str) else json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        train_and_evaluate(config, str(tmp_path / "run"), devices=jax.devices()[:1], log=lambda *_: None)
    message = str(e.value)
    print(message)
    assert expected in message and "\n" not in message and str(path) in message
    assert not (tmp_path / "run").exists()


def test_dpo_refuses_diloco_and_2bw_and_an_unknown_loss_in_one_line():
    from parallax.plan import make_plan

    for mesh, key, value, expected in [
            (dict(replica=2), None, None, "config.mesh.replica=2: DPO"),
            (dict(pipe=2), "pipeline.schedule", "2bw", "DPO (data.source='preference') needs a flushing schedule"),
            ({}, "dpo.loss_type", "hinge", "config.dpo.loss_type='hinge': expected one of sigmoid, ipo")]:
        config = _config(**mesh)
        if key:
            section, name = key.split(".")
            config[section][name] = value
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            make_plan(config, 2 if mesh else 1)
