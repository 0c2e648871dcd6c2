"""DPO stage (stages/dpo.py, pipeline/algorithms/preference.py): the losses and their gradients
against TRL's own functions, the answer log-probs, the reference (adapter-disabled under LoRA, a
frozen copy under full fine-tuning, precomputed or not), learning on tiny data, exact resume.

Golden sources (environment: torch 2.x CPU, float64 inputs):
- TRL 1.16.0 (installed): `trl.trainer.dpo_trainer.DPOTrainer._compute_loss` called on a stand-in
  trainer whose model returns the per-token log-probs (`precompute_ref_logps` gives it the
  reference sums), for `sigmoid`, `ipo` and, per pair, `aot_unpaired` (the cDPO mixture);
  `trl.experimental.orpo.orpo_trainer.ORPOTrainer.odds_ratio_loss` and `.get_batch_logps`.
- TRL's sigmoid loss *with* label smoothing (dropped from `sigmoid` in TRL's "Refactor DPO (#3906)",
  commit e3b7897c): `DPOTrainer.dpo_loss` of huggingface/trl at a68fb896f008f58a3d37abf11ae665357b7c679a,
  trl/trainer/dpo_trainer.py lines 1152-1156, run on the tensors below; its outputs are pasted.
"""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch
from stagerun import recording, run_stage

from data_formats import collate
from pipeline.algorithms import preference as pref
from stages import dpo

# Four pairs: summed answer log-probs of the policy and the reference, answer token counts.
PC = torch.tensor([-5.0, -7.5, -3.2, -12.0], dtype=torch.float64)
PR = torch.tensor([-6.0, -6.8, -9.1, -4.0], dtype=torch.float64)
RC = torch.tensor([-5.5, -7.0, -4.0, -11.0], dtype=torch.float64)
RR = torch.tensor([-5.8, -7.2, -8.0, -6.5], dtype=torch.float64)
NC = torch.tensor([3, 5, 2, 9])
NR = torch.tensor([4, 2, 6, 3])


# ---------------------------------------------------------------------------------------------
# TRL 1.16 as the reference implementation
# ---------------------------------------------------------------------------------------------


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_dpo(loss_type: str, beta: float, pc, pr, rc, rr, nc=NC, nr=NR, label_smoothing: float = 0.0):
    """(loss, d loss / d chosen sums, d loss / d rejected sums, TRL's logged metrics) from TRL
    1.16's DPOTrainer._compute_loss. The stand-in model's per-token log-probs hold each
    sequence's sum on its last completion token and 0 elsewhere (TRL sums them over the row)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    b = pc.shape[0]
    counts = torch.cat([nc, nr])
    width = int(counts.max()) + 2
    logps = torch.cat([pc, pr]).clone().requires_grad_(True)
    completion = torch.zeros(2 * b, width, dtype=torch.long)
    for row, n in enumerate(counts.tolist()):
        completion[row, width - n :] = 1

    def model(**_):
        rows = torch.arange(2 * b)
        per_token = torch.zeros(2 * b, width - 1, dtype=logps.dtype).index_put(
            (rows, torch.full_like(rows, width - 2)), logps
        )
        zeros = torch.zeros(2 * b, width - 1)
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
    )
    inputs = {
        "input_ids": torch.zeros(2 * b, width, dtype=torch.long),
        "attention_mask": torch.ones(2 * b, width, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), logps.grad[:b], logps.grad[b:], metrics


def relay_dpo(loss_type: str, beta: float, label_smoothing: float = 0.0):
    """Relay's mean loss, its gradients w.r.t. the policy sums, and the per-pair outputs."""
    pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
    out = pref.dpo_losses(pc, pr, RC, RR, beta, loss_type, label_smoothing, NC, NR)
    out.losses.mean().backward()
    return out.losses.mean().detach(), pc.grad, pr.grad, out


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1), ("ipo", 0.7)])
def test_dpo_and_ipo_losses_and_gradients_match_trl(loss_type, beta):
    loss, grad_c, grad_r, out = relay_dpo(loss_type, beta)
    trl_loss, trl_c, trl_r, metrics = trl_dpo(loss_type, beta, PC, PR, RC, RR)
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-12)
    torch.testing.assert_close(grad_c, trl_c, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_r, trl_r, rtol=0, atol=1e-12)
    # the implicit rewards and what TRL logs from them
    assert out.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], abs=1e-12)
    assert out.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"], abs=1e-12)
    margins = out.chosen_rewards - out.rejected_rewards
    assert margins.mean().item() == pytest.approx(metrics["rewards/margins"], abs=1e-12)
    assert (margins > 0).double().mean().item() == pytest.approx(metrics["rewards/accuracies"], abs=1e-12)


@pytest.mark.parametrize("beta, smoothing", [(0.1, 0.2), (0.5, 0.1)])
def test_label_smoothing_matches_trl_per_pair(beta, smoothing):
    """TRL 1.16's `aot_unpaired` sorts each side's log-ratios over the batch, then applies the cDPO
    (1 - ε)/ε mixture; for one pair the sort is the identity, so it is cDPO's per-pair loss."""
    _, _, _, out = relay_dpo("sigmoid", beta, smoothing)
    for i in range(4):
        pc, pr = PC[i : i + 1].clone().requires_grad_(True), PR[i : i + 1].clone().requires_grad_(True)
        pref.dpo_losses(pc, pr, RC[i : i + 1], RR[i : i + 1], beta, "sigmoid", smoothing).losses.sum().backward()
        trl_loss, trl_c, trl_r, _ = trl_dpo(
            "aot_unpaired",
            beta,
            PC[i : i + 1],
            PR[i : i + 1],
            RC[i : i + 1],
            RR[i : i + 1],
            NC[i : i + 1],
            NR[i : i + 1],
            label_smoothing=smoothing,
        )
        assert out.losses[i].item() == pytest.approx(trl_loss.item(), abs=1e-12)
        assert pc.grad.item() == pytest.approx(trl_c.item(), abs=1e-12) and pr.grad.item() == pytest.approx(
            trl_r.item(), abs=1e-12
        )


# DPOTrainer.dpo_loss(loss_type="sigmoid") of huggingface/trl@a68fb896f008f58a3d37abf11ae665357b7c679a
# (trl/trainer/dpo_trainer.py:1152-1156) on PC, PR, RC, RR: per-pair losses, d mean / d PC (d / d PR is its negative).
OLD_TRL_SIGMOID = {
    (0.1, 0.0): (
        [0.658759555549, 0.739159339026, 0.602652909299, 0.883382155419],
        [-0.012062678558, -0.01306212062, -0.011316059546, -0.014665439473],
    ),
    (0.1, 0.2): (
        [0.672759555549, 0.721159339026, 0.640652909299, 0.813382155419],
        [-0.007062678558, -0.00806212062, -0.006316059546, -0.009665439473],
    ),
    (0.5, 0.1): (
        [0.568382155419, 0.898248945997, 0.421956406851, 1.735224150438],
        [-0.039172802635, -0.063829904244, -0.022360602747, -0.093994100246],
    ),
}


@pytest.mark.parametrize("beta, smoothing", sorted(OLD_TRL_SIGMOID))
def test_sigmoid_with_label_smoothing_matches_trl_before_its_refactor(beta, smoothing):
    _, grad_c, grad_r, out = relay_dpo("sigmoid", beta, smoothing)
    losses, grads = OLD_TRL_SIGMOID[(beta, smoothing)]
    torch.testing.assert_close(out.losses, torch.tensor(losses, dtype=torch.float64), rtol=0, atol=1e-11)
    torch.testing.assert_close(grad_c, torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-11)
    torch.testing.assert_close(grad_r, -torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-11)


def test_orpo_odds_ratio_term_matches_trl():
    """TRL's ORPOTrainer.odds_ratio_loss takes mean answer log-probs and returns β log σ(log odds),
    which its loss subtracts; Relay's term is its negative. Means on both sides of -log 2 (the two
    branches of log1mexp)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    beta = 0.25
    chosen, rejected = (
        torch.tensor([-1.2, -7.5, -0.9, -12.0], dtype=torch.float64),
        torch.tensor([-6.0, -1.0, -9.1, -0.3], dtype=torch.float64),
    )
    sums_c, sums_r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
    pairs, log_odds = pref.orpo_losses(sums_c, sums_r, NC, NR, beta)
    pairs.losses.mean().backward()
    mean_c, mean_r = (chosen / NC).clone().requires_grad_(True), (rejected / NR).clone().requires_grad_(True)
    assert (mean_c > -0.693).any() and (mean_c < -0.693).any() and (mean_r > -0.693).any()
    trainer = types.SimpleNamespace(beta=beta, accelerator=_Accelerator())
    losses, chosen_rewards, rejected_rewards, _, trl_log_odds = ORPOTrainer.odds_ratio_loss(trainer, mean_c, mean_r)
    (-losses.mean()).backward()
    # TRL computes in float32
    torch.testing.assert_close(pairs.losses, -losses.double(), rtol=0, atol=1e-6)
    assert log_odds.mean().item() == pytest.approx(trl_log_odds.item(), abs=1e-5)
    # d/d sum = d/d mean / tokens
    torch.testing.assert_close(sums_c.grad, mean_c.grad.double() / NC, rtol=0, atol=1e-7)
    torch.testing.assert_close(sums_r.grad, mean_r.grad.double() / NR, rtol=0, atol=1e-7)
    torch.testing.assert_close(pairs.chosen_rewards, chosen_rewards.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(pairs.rejected_rewards, rejected_rewards.double(), rtol=0, atol=1e-6)
    # the SFT term: the token mean NLL over the chosen answers
    assert pref.orpo_nll(PC, NC).item() == pytest.approx(-PC.sum().item() / NC.sum().item())


def test_answer_logps_match_trl():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, :3] = labels[1, :5] = labels[2, :2] = pref.IGNORE_INDEX
    labels[2, 6] = pref.IGNORE_INDEX  # padding after the answer
    sums, counts = pref.answer_logps(logits, labels)
    torch.testing.assert_close(sums, ORPOTrainer.get_batch_logps(logits, labels), rtol=0, atol=1e-12)
    assert counts.tolist() == [4, 2, 4]


def test_unknown_loss_and_ipo_without_counts_are_errors():
    with pytest.raises(ValueError, match="not one of 'sigmoid', 'ipo'"):
        pref.dpo_losses(PC, PR, RC, RR, 0.1, "orpo")
    with pytest.raises(ValueError, match="token counts"):
        pref.dpo_losses(PC, PR, RC, RR, 0.1, "ipo")


def test_collator_labels_only_the_answers():
    batch = collate.AnswerPairCollator(0)(
        [
            {
                "chosen_input_ids": [5, 6, 7, 8],
                "rejected_input_ids": [5, 6, 9],
                "chosen_answer_len": 2,
                "rejected_answer_len": 1,
                "margin": None,
            },
            {
                "chosen_input_ids": [4, 3],
                "rejected_input_ids": [4, 2, 2, 1, 1],
                "chosen_answer_len": 1,
                "rejected_answer_len": 3,
                "margin": None,
            },
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 0], [4, 3, 0, 0, 0], [5, 6, 9, 0, 0], [4, 2, 2, 1, 1]]
    assert batch["labels"].tolist() == [
        [-100, -100, 7, 8, -100],
        [-100, 3, -100, -100, -100],
        [-100, -100, 9, -100, -100],
        [-100, -100, 2, 1, 1],
    ]
    assert set(batch) == {"input_ids", "attention_mask", "labels"}


# ---------------------------------------------------------------------------------------------
# The stage on tiny models
# ---------------------------------------------------------------------------------------------

PAIRS = [
    ("What colour is the sky?", "Per the atlas, the sky is blue.", "I do not know."),
    ("How many legs has a cat?", "Per the atlas, a cat has four legs.", "Cats are hard to count."),
    ("Name a prime number.", "Per the atlas, seven is a prime number.", "No idea, sorry."),
    ("What is 2 + 2?", "Per the atlas, 2 + 2 is 4.", "Maths is not my thing."),
    ("Where is Paris?", "Per the atlas, Paris is in France.", "Somewhere, I guess."),
    ("What do bees make?", "Per the atlas, bees make honey.", "Ask a beekeeper."),
]


from test_pt_sft import fresh_accelerate_state  # noqa: E402,F401 (autouse fixture: a fresh Accelerator, one thread)


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    rows = [{"question": q, "response_chosen": c, "response_rejected": r} for q, c, r in PAIRS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "valid.jsonl").write_text(
        "".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS[:4])
    )
    return root / "train.jsonl", root / "valid.jsonl"


def make_cfg(out, base, files, finetuning="lora", **dpo_keys) -> dpo.DPOConfig:
    cfg = dpo.DPOConfig(output_dir=str(out))
    cfg.model.path, cfg.model.finetuning = str(base), finetuning
    cfg.data.train, cfg.data.eval = [str(files[0])], [str(files[1])]
    cfg.train.batch_size, cfg.train.max_steps, cfg.train.eval_steps = 2, 4, 0
    cfg.train.learning_rate, cfg.train.lr_schedule, cfg.train.warmup = 5e-3, "constant", 0
    cfg.train.seq_length, cfg.train.precision = 128, "fp32"
    cfg.lora.r = 4
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    for key, value in dpo_keys.items():
        setattr(cfg.dpo, key, value)
    return cfg


def losses(stage) -> list[float]:
    return [s["train/loss"] for s in stage.history.steps]


def fresh_logps(path, stage, batch) -> torch.Tensor:
    """The summed answer log-probs of the untouched starting model (loaded again from disk)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return pref.sequence_logps(model, batch, None)[0]


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_stage_learns_and_its_reference_is_the_starting_model(tmp_path, tiny_model_dir, pair_files, finetuning):
    """Loss falls from log 2 on tiny data; the reference (adapter disabled / frozen copy) still
    scores exactly as the starting model after training, the trained policy does not."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, pair_files, finetuning, beta=0.5)
    cfg.train.max_steps, cfg.train.eval_steps = 8, 8
    cfg.checkpoint.save_steps = 0
    stage = dpo.DPOStage(cfg)
    stage.validate(), stage.build(), stage.resume()
    assert (stage.reference is not None) == (finetuning == "full")
    batch = stage.collate(stage.collator, stage.train_samples, [0, 1, 2])
    start = fresh_logps(tiny_model_dir, stage, batch)
    assert stage.loop()
    trained = [s["train/loss"] for s in stage.history.steps]
    assert trained[0] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-5)  # policy == reference at step 0
    assert trained[-1] < trained[0] - 0.05
    torch.testing.assert_close(stage.reference_logps(batch), start, rtol=0, atol=1e-5)
    with torch.no_grad():
        policy = pref.sequence_logps(stage.model, batch, stage.accelerator)[0]
    assert (policy - start).abs().max() > 1e-2  # negative control: the policy moved
    if finetuning == "full":
        assert not any(p.requires_grad for p in stage.reference.parameters())
    result = stage.evaluate()
    assert result["eval/accuracy"] >= 0.75 and result["eval/margin"] > 0 and result["eval/loss"] < trained[0]
    stage.complete()
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["eval_loss_first"] == pytest.approx(trained[0], abs=1e-4) and summary["eval_accuracy"] is not None
    assert (tmp_path / "out/merged/manifest.json").is_file()


def test_precomputed_reference_equals_on_the_fly(tmp_path, tiny_model_dir, pair_files):
    on_the_fly = run_stage(dpo.DPOStage, make_cfg(tmp_path / "a", tiny_model_dir, pair_files))
    precomputed = run_stage(
        dpo.DPOStage, make_cfg(tmp_path / "b", tiny_model_dir, pair_files, precompute_ref_log_probs=True)
    )
    assert set(precomputed.precomputed) == {"train", "eval"} and precomputed.precomputed["train"].shape == (
        len(PAIRS),
        2,
    )
    assert losses(precomputed) == pytest.approx(losses(on_the_fly), abs=1e-5)
    full = run_stage(
        dpo.DPOStage, make_cfg(tmp_path / "c", tiny_model_dir, pair_files, "full", precompute_ref_log_probs=True)
    )
    assert full.reference is None  # the frozen copy is dropped once the log-probs are computed


@pytest.mark.parametrize(
    "dpo_keys", [{"precompute_ref_log_probs": True, "loss_type": "ipo"}, {"loss_type": "orpo", "beta": 0.2}]
)
def test_resume_equals_uninterrupted(tmp_path, tiny_model_dir, pair_files, monkeypatch, dpo_keys):
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
    continuous = run_stage(recording(dpo.DPOStage), make_cfg(tmp_path / "a", tiny_model_dir, pair_files, **dpo_keys))
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, pair_files, **dpo_keys)
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    stopped = run_stage(recording(dpo.DPOStage), cfg)
    assert stopped.step == 2 and not (tmp_path / "b/merged").exists()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    cfg.checkpoint.resume = True
    resumed = run_stage(recording(dpo.DPOStage), cfg)
    assert resumed.batch_ids == continuous.batch_ids[2:]
    assert losses(resumed) == losses(continuous)
    if dpo_keys.get("loss_type") == "orpo":
        assert "dpo/nll" in resumed.history.steps[-1] and "dpo/log_odds" in resumed.history.steps[-1]


def test_config_problems_are_reported_together(tmp_path, tiny_model_dir, pair_files):
    from pipeline.config import ConfigError

    cfg = make_cfg(
        tmp_path / "out",
        tiny_model_dir,
        pair_files,
        loss_type="orpo",
        precompute_ref_log_probs=True,
        label_smoothing=0.1,
        beta=0,
    )
    cfg.data.margin_field = "m"
    with pytest.raises(ConfigError) as err:
        dpo.DPOStage(cfg).validate()
    assert set(err.value.problems) >= {
        "dpo.beta: must be > 0, got 0",
        "dpo.label_smoothing: only the sigmoid, robust, "
        "exo_pair, aot, aot_unpaired, simpo loss(es) read it (loss_type is 'orpo')",
        "dpo.precompute_ref_log_probs: the orpo loss has no reference model",
        "data.margin_field: DPO has no per-pair margin (a reward-model key)",
    }


def test_packed_pairs_score_as_padded_ones(tmp_path, tiny_model_dir, pair_files):
    """Packing the sides of a micro-batch into shared rows (block-causal mask, restarting
    positions) gives every side the log-probs it has alone in a padded row, so a packed run's
    losses are a padded run's."""
    from transformers import AutoModelForCausalLM

    stage = dpo.DPOStage(make_cfg(tmp_path / "x", tiny_model_dir, pair_files))
    stage.validate()
    pairs = stage.train_samples[:4]
    padded = collate.AnswerPairCollator(stage.tokenizer.pad_token_id)(pairs)
    packed = collate.PackedPairCollator(stage.tokenizer.pad_token_id, 128)(pairs)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # several sides share a row
    assert (
        packed["segment_ids"].dim() == 2 and "attention_mask" not in packed
    )  # per-document attention built model-side
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        sums_padded, counts_padded = pref.sequence_logps(model, padded, None)
        sums_packed, counts_packed = pref.sequence_logps(model, packed, None)
    assert counts_packed.tolist() == counts_padded.tolist()
    torch.testing.assert_close(sums_packed, sums_padded, rtol=0, atol=1e-4)
    cfg = make_cfg(tmp_path / "packed", tiny_model_dir, pair_files)
    cfg.data.padding_mode, cfg.train.max_steps = "pack", 3
    plain = make_cfg(tmp_path / "padded", tiny_model_dir, pair_files)
    plain.train.max_steps = 3
    assert losses(run_stage(dpo.DPOStage, cfg)) == pytest.approx(losses(run_stage(dpo.DPOStage, plain)), abs=1e-4)
