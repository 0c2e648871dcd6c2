"""Every `dpo.loss_type` in the LOSSES registry (pipeline/algorithms/preference.py) against TRL
1.16's own code on the same random tensors, ragged answer lengths, in float32 (the issue's bar:
<= 1e-6) and float64 (to 1e-12); the config refuses options a loss does not read.

Golden sources (TRL 1.16.0, installed; environment: torch CPU):
- `trl.trainer.dpo_trainer.DPOTrainer._compute_loss` on a stand-in trainer whose model returns
  per-token log-probs holding each answer's sum on one completion token (TRL sums them over the
  row), with precomputed reference sums, for every DPOConfig.loss_type Relay registers: the loss
  and its gradient w.r.t. the policy sums, and TRL's logged rewards.
- `trl.experimental.cpo.CPOTrainer.get_batch_loss_metrics` (loss_type 'simpo') on a stand-in
  trainer whose model returns fixed logits: TRL's own concatenation, average log-probs, NLL and
  SimPO loss, compared with Relay's `answer_logps` + `simpo_loss` on the same logits and labels,
  gradients w.r.t. the logits included.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from pipeline.algorithms import preference as pref
from stages import dpo

B = 8
# the options of each loss type (TRL's names); the rest of TRL's defaults otherwise
OPTIONS = {
    "exo_pair": {"label_smoothing": 1e-3},
    "robust": {"label_smoothing": 0.2},
    "aot": {"label_smoothing": 0.1},
    "aot_unpaired": {"label_smoothing": 0.15},
    "discopop": {"discopop_tau": 0.07},
}
REFERENCE_BASED = [n for n in pref.LOSS_TYPES if n not in pref.REFERENCE_FREE]


def pairs(dtype, seed=0):
    """Random summed answer log-probs (policy, reference) and ragged answer token counts [1, 20]."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 21, (2 * B,), generator=gen)
    policy = -(torch.rand(2 * B, generator=gen, dtype=torch.float64) * 2.5 + 0.2) * counts
    ref = policy + torch.randn(2 * B, generator=gen, dtype=torch.float64) * 3.0
    return policy.to(dtype), ref.to(dtype), counts


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_dpo(loss_type, beta, policy, ref, counts, label_smoothing=0.0, discopop_tau=0.05):
    """(loss, d loss / d policy sums [2B], TRL's metrics) from TRL 1.16's DPOTrainer._compute_loss."""
    from trl.trainer.dpo_trainer import DPOTrainer

    n = policy.shape[0]
    width = int(counts.max()) + 2
    logps = policy.clone().requires_grad_(True)
    completion = torch.zeros(n, width, dtype=torch.long)
    for row, k in enumerate(counts.tolist()):
        completion[row, width - k :] = 1

    def model(**_):
        rows = torch.arange(n)
        per_token = torch.zeros(n, width - 1, dtype=logps.dtype).index_put(
            (rows, torch.full_like(rows, width - 2)), logps
        )
        zeros = torch.zeros(n, width - 1)
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(discopop_tau=discopop_tau),
    )
    inputs = {
        "input_ids": torch.zeros(n, width, dtype=torch.long),
        "attention_mask": torch.ones(n, width, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": ref[: n // 2],
        "ref_rejected_logps": ref[n // 2 :],
    }
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), logps.grad, {k: v[0] for k, v in trainer._metrics["train"].items()}


def section(loss_type, beta, **options) -> dpo.DPOSection:
    return dpo.DPOSection(loss_type=loss_type, beta=beta, **options)


def relay(loss_type, beta, policy, ref, counts, **options):
    """Relay's batch loss through the stage's entry point (`pair_losses`), its gradient, its figures."""
    sums = policy.clone().requires_grad_(True)
    loss, figures = pref.pair_losses(section(loss_type, beta, **options), sums, counts, ref)
    loss.backward()
    return loss.detach(), sums.grad, figures


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("loss_type", REFERENCE_BASED)
def test_every_dpo_loss_type_matches_trl(loss_type, dtype, tol):
    options = OPTIONS.get(loss_type, {})
    if loss_type == "exo_pair" and dtype == torch.float64:
        tol = 1e-7  # TRL makes ε a float32 tensor (torch.tensor(label_smoothing)), so its log(ε) is float32's
    for beta, seed in ((0.1, 0), (0.5, 1)):
        policy, ref, counts = pairs(dtype, seed)
        loss, grad, figures = relay(loss_type, beta, policy, ref, counts, **options)
        trl_loss, trl_grad, metrics = trl_dpo(loss_type, beta, policy, ref, counts, **options)
        scale = max(1.0, abs(trl_loss.item()))
        assert abs(loss.item() - trl_loss.item()) <= tol * scale, (loss_type, beta, loss.item(), trl_loss.item())
        torch.testing.assert_close(grad, trl_grad, rtol=tol, atol=tol)
        assert figures["rewards_chosen"].mean().item() == pytest.approx(metrics["rewards/chosen"], abs=10 * tol)
        assert figures["rewards_rejected"].mean().item() == pytest.approx(metrics["rewards/rejected"], abs=10 * tol)
        assert figures["accuracy"].mean().item() == pytest.approx(metrics["rewards/accuracies"], abs=1e-7)


def test_trl_sigmoid_is_relays_without_smoothing_and_every_trl_loss_type_is_registered_but_sft():
    """The registry covers TRL 1.16's list (read from its error message) except `sft`, the SFT stage's job."""
    import inspect

    from trl.trainer.dpo_trainer import DPOTrainer

    source = inspect.getsource(DPOTrainer._compute_loss)
    listed = source[source.index("Should be one of [") :].split("]")[0]
    trl_types = {name.strip(" '\"\n") for name in listed.split("[", 1)[1].replace('"', "").split(",")}
    assert trl_types - set(pref.LOSS_TYPES) == {"sft"}, trl_types


def test_sorting_losses_are_the_batch_mean_not_per_pair():
    """aot/aot_unpaired sort over the micro-batch (TRL's), so per-pair values are of sorted positions:
    the figure 'loss' has the batch's mean, and a one-pair batch is cDPO's loss."""
    policy, ref, counts = pairs(torch.float64)
    one = pref.dpo_losses(policy[:1], policy[B : B + 1], ref[:1], ref[B : B + 1], 0.3, "aot_unpaired", 0.1).losses
    cdpo = pref.dpo_losses(policy[:1], policy[B : B + 1], ref[:1], ref[B : B + 1], 0.3, "sigmoid", 0.1).losses
    torch.testing.assert_close(one, cdpo, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# SimPO against TRL's CPOTrainer
# ---------------------------------------------------------------------------------------------


def simpo_batch(dtype, seed=3, width=12, vocab=17):
    """Logits [2B, T, V] (a leaf) and chosen/rejected rows with labels on ragged answers."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2 * B, width, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (2 * B, width), generator=gen)
    labels = ids.clone()
    for row in range(2 * B):
        prompt = int(torch.randint(1, width // 2, (1,), generator=gen))
        pad = int(torch.randint(0, width - prompt - 1, (1,), generator=gen))
        labels[row, :prompt] = -100
        if pad:
            labels[row, width - pad :] = -100
    return logits, ids, labels


def trl_simpo(logits, ids, labels, beta, gamma, smoothing, cpo_alpha):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = types.SimpleNamespace(
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
        cpo_alpha=cpo_alpha,
        loss_type="simpo",
        alpha=0.0,
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=smoothing,
        accelerator=_Accelerator(),
    )
    for name in ("concatenated_forward", "cpo_loss"):
        setattr(trainer, name, types.MethodType(getattr(CPOTrainer, name), trainer))
    trainer.concatenated_inputs, trainer.get_batch_logps = CPOTrainer.concatenated_inputs, CPOTrainer.get_batch_logps
    batch = {
        "chosen_input_ids": ids[:B],
        "chosen_attention_mask": torch.ones_like(ids[:B]),
        "chosen_labels": labels[:B],
        "rejected_input_ids": ids[B:],
        "rejected_attention_mask": torch.ones_like(ids[B:]),
        "rejected_labels": labels[B:],
    }

    def model(input_ids, **_):
        assert torch.equal(input_ids, ids)
        return types.SimpleNamespace(logits=logits)

    loss, metrics = CPOTrainer.get_batch_loss_metrics(trainer, model, batch)
    return loss, metrics


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize(
    "beta, gamma, smoothing, cpo_alpha", [(2.0, 0.5, 0.0, 0.0), (2.5, 1.4, 0.1, 0.0), (0.7, 0.3, 0.0, 1.0)]
)
def test_simpo_matches_trl_cpo_trainer(beta, gamma, smoothing, cpo_alpha, dtype, tol):
    logits, ids, labels = simpo_batch(dtype)
    trl_loss, metrics = trl_simpo(logits, ids, labels, beta, gamma, smoothing, cpo_alpha)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)
    sums, counts = pref.answer_logps(logits, labels)
    loss, figures = pref.pair_losses(
        section("simpo", beta, simpo_gamma=gamma, label_smoothing=smoothing, cpo_alpha=cpo_alpha), sums, counts, None
    )
    (grad,) = torch.autograd.grad(loss, logits)
    assert abs(loss.item() - trl_loss.item()) <= tol * max(1.0, abs(trl_loss.item()))
    torch.testing.assert_close(grad, trl_grad, rtol=tol, atol=tol)
    assert figures["rewards_chosen"].mean().item() == pytest.approx(metrics["rewards/chosen"], abs=10 * tol)
    assert figures["rewards_rejected"].mean().item() == pytest.approx(metrics["rewards/rejected"], abs=10 * tol)
    if cpo_alpha:
        assert figures["nll"][0].item() == pytest.approx(metrics["nll_loss"], abs=10 * tol)


# ---------------------------------------------------------------------------------------------
# The config: each option with the losses that read it, one line per conflict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys, line",
    [
        (
            {"loss_type": "hinge", "label_smoothing": 0.1},
            "dpo.label_smoothing: only the sigmoid, robust, "
            "exo_pair, aot, aot_unpaired, simpo loss(es) read it (loss_type is 'hinge')",
        ),
        (
            {"loss_type": "sigmoid", "simpo_gamma": 1.0},
            "dpo.simpo_gamma: only the simpo loss(es) read it (loss_type is 'sigmoid')",
        ),
        (
            {"loss_type": "orpo", "cpo_alpha": 1.0},
            "dpo.cpo_alpha: only the simpo loss(es) read it (loss_type is 'orpo')",
        ),
        (
            {"loss_type": "ipo", "discopop_tau": 0.1},
            "dpo.discopop_tau: only the discopop loss(es) read it (loss_type is 'ipo')",
        ),
        ({"loss_type": "exo_pair"}, "dpo.label_smoothing: the exo_pair loss needs it > 0 (EXO suggests 1e-3)"),
        (
            {"loss_type": "simpo", "precompute_ref_log_probs": True},
            "dpo.precompute_ref_log_probs: the simpo loss has no reference model",
        ),
        ({"loss_type": "discopop", "discopop_tau": 0.0}, "dpo.discopop_tau: must be > 0, got 0.0"),
        ({"loss_type": "kto"}, "dpo.loss_type: 'kto' is not one of " + ", ".join(map(repr, pref.LOSS_TYPES))),
    ],
)
def test_conflicting_options_are_one_line_each(keys, line):
    assert dpo.DPOSection(**keys).problems() == [line]


@pytest.mark.parametrize("loss_type", pref.LOSS_TYPES)
def test_every_loss_type_with_its_options_is_accepted(loss_type):
    assert dpo.DPOSection(loss_type=loss_type, **OPTIONS.get(loss_type, {})).problems() == []


# ---------------------------------------------------------------------------------------------
# Two steps of the DPO stage with a new loss type against TRL's DPOTrainer
# ---------------------------------------------------------------------------------------------

from test_pt_sft import fresh_accelerate_state  # noqa: E402,F401  (autouse: fresh accelerate state, one intra-op thread)

PAIRS = [
    ("What colour is the sky?", "Per the atlas, the sky is blue.", "I do not know."),
    ("How many legs has a cat?", "Per the atlas, a cat has four legs.", "Cats are hard to count."),
    ("Name a prime number.", "Per the atlas, seven is a prime number.", "No idea, sorry."),
    ("What is 2 + 2?", "Per the atlas, 2 + 2 is 4.", "Maths is not my thing."),
    ("Where is Paris?", "Per the atlas, Paris is in France.", "Somewhere, I guess."),
    ("What do bees make?", "Per the atlas, bees make honey.", "Ask a beekeeper."),
    ("What is ice?", "Per the atlas, ice is frozen water.", "Cold stuff?"),
    ("Is the sun a star?", "Per the atlas, the sun is a star.", "It is a planet."),
]
OPTIM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def trl_dpo_run(base, order, workdir, loss_type, beta, steps=2, batch=4):
    """TRL's DPOTrainer (full fine-tuning) on PAIRS in `order`: (logged steps, its token ids per pair)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": PAIRS[i][0]}], add_generation_prompt=True, tokenize=False
            ),
            "chosen": PAIRS[i][1],
            "rejected": PAIRS[i][2],
        }
        for i in order
    ]
    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                store.append(dict(logs))

    store = logs
    args = DPOConfig(
        output_dir=str(workdir),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=OPTIM["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=OPTIM["beta1"],
        adam_beta2=OPTIM["beta2"],
        adam_epsilon=OPTIM["eps"],
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=beta,
        loss_type=[loss_type],
        max_length=128,
        train_sampling_strategy="sequential",
        disable_dropout=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=42,
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[Record()]
    )
    ids = [(r["prompt_ids"] + r["chosen_ids"], r["prompt_ids"] + r["rejected_ids"]) for r in trainer.train_dataset]
    trainer.train()
    return logs, ids


def test_two_dpo_steps_with_nca_pair_equal_trls_dpo_trainer(tmp_path, tiny_model_dir):
    """Full fine-tuning, the same 8 pairs in Relay's order, 2 steps of 4: step 1's loss (at policy ==
    reference, 2·log 2 for nca_pair) and step 2's loss and implicit rewards, which depend on the
    first update, equal TRL's within 1e-5."""
    import json

    from stagerun import recording, run_stage

    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(json.dumps({"question": q, "response_chosen": c, "response_rejected": r}) + "\n" for q, c, r in PAIRS)
    )
    cfg = dpo.DPOConfig(output_dir=str(tmp_path / "relay"))
    cfg.model.path, cfg.model.finetuning = str(tiny_model_dir), "full"
    cfg.data.train, cfg.data.eval = [str(path)], []
    t = cfg.train
    t.batch_size, t.max_steps, t.eval_steps, t.seq_length, t.precision = 4, 2, 0, 128, "fp32"
    t.learning_rate, t.lr_schedule, t.warmup, t.beta1, t.beta2, t.epsilon = (
        OPTIM["lr"],
        "constant",
        0,
        OPTIM["beta1"],
        OPTIM["beta2"],
        OPTIM["eps"],
    )
    cfg.checkpoint.resume, cfg.checkpoint.save_interval, cfg.tracking.trackers = False, "1000h", []
    cfg.dpo.loss_type, cfg.dpo.beta = "nca_pair", 0.5
    stage = run_stage(recording(dpo.DPOStage), cfg)
    order = [i for step in stage.batch_ids for group in step for i in group]
    logs, trl_ids = trl_dpo_run(tiny_model_dir, order, tmp_path / "trl", "nca_pair", 0.5)
    assert trl_ids == [
        (stage.train_samples[i]["chosen_input_ids"], stage.train_samples[i]["rejected_input_ids"]) for i in order
    ]
    ours = stage.history.steps
    assert len(logs) == len(ours) == 2
    assert ours[0]["train/loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    for step in range(2):
        assert ours[step]["train/loss"] == pytest.approx(logs[step]["loss"], abs=1e-5), (step, ours[step], logs[step])
        assert ours[step]["dpo/rewards_chosen"] == pytest.approx(logs[step]["rewards/chosen"], abs=1e-5)
        assert ours[step]["dpo/rewards_rejected"] == pytest.approx(logs[step]["rewards/rejected"], abs=1e-5)
    assert abs(ours[1]["train/margin"]) > 1e-3  # the second step is not the trivial start


@pytest.mark.parametrize(
    "loss_type, keys", [("simpo", {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5}), ("apo_zero", {"beta": 0.5})]
)
def test_stage_trains_with_a_new_loss_type(tmp_path, tiny_model_dir, loss_type, keys):
    """The DPO stage runs any registered loss: SimPO under full fine-tuning loads no reference copy
    (reference-free) and logs its NLL term; the loss falls on tiny data."""
    import json

    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(json.dumps({"question": q, "response_chosen": c, "response_rejected": r}) + "\n" for q, c, r in PAIRS)
    )
    cfg = dpo.DPOConfig(output_dir=str(tmp_path / "out"))
    cfg.model.path, cfg.model.finetuning = str(tiny_model_dir), "full"
    cfg.data.train, cfg.data.eval = [str(path)], []
    t = cfg.train
    t.batch_size, t.max_steps, t.eval_steps, t.seq_length, t.precision = 4, 6, 0, 128, "fp32"
    t.learning_rate, t.lr_schedule, t.warmup = 1e-3, "constant", 0
    cfg.checkpoint.resume, cfg.checkpoint.save_interval, cfg.tracking.trackers = False, "1000h", []
    cfg.dpo.loss_type = loss_type
    for key, value in keys.items():
        setattr(cfg.dpo, key, value)
    stage = dpo.DPOStage(cfg)
    stage.validate(), stage.build(), stage.resume()
    assert (stage.reference is None) == (loss_type == "simpo")  # a full-FT reference copy only where the loss reads one
    assert stage.loop()
    stage.complete()
    losses = [s["train/loss"] for s in stage.history.steps]
    assert losses[-1] < losses[0]
    assert ("dpo/nll" in stage.history.steps[-1]) == (loss_type == "simpo")
    assert json.loads((tmp_path / "out/summary.json").read_text())["loss_type"] == loss_type
