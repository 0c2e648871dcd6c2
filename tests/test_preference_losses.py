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

import types
from collections import defaultdict

import pytest
import torch

from pipeline.algorithms import preference as pref
from stages import dpo

B = 8
# the options of each loss type (TRL's names); the rest of TRL's defaults otherwise
OPTIONS = {"exo_pair": {"label_smoothing": 1e-3}, "robust": {"label_smoothing": 0.2}, "aot": {"label_smoothing": 0.1},
           "aot_unpaired": {"label_smoothing": 0.15}, "discopop": {"discopop_tau": 0.07}}
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
        completion[row, width - k:] = 1

    def model(**_):
        rows = torch.arange(n)
        per_token = torch.zeros(n, width - 1, dtype=logps.dtype).index_put((rows, torch.full_like(rows, width - 2)), logps)
        zeros = torch.zeros(n, width - 1)
        return types.SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1, args=types.SimpleNamespace(discopop_tau=discopop_tau))
    inputs = {"input_ids": torch.zeros(n, width, dtype=torch.long), "attention_mask": torch.ones(n, width, dtype=torch.long),
              "completion_mask": completion, "ref_chosen_logps": ref[: n // 2], "ref_rejected_logps": ref[n // 2:]}
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
    trl_types = {name.strip(" '\"\n") for name in listed.split("[", 1)[1].replace("\"", "").split(",")}
    assert trl_types - set(pref.LOSS_TYPES) == {"sft"}, trl_types


def test_sorting_losses_are_the_batch_mean_not_per_pair():
    """aot/aot_unpaired sort over the micro-batch (TRL's), so per-pair values are of sorted positions:
    the figure 'loss' has the batch's mean, and a one-pair batch is cDPO's loss."""
    policy, ref, counts = pairs(torch.float64)
    one = pref.dpo_losses(policy[:1], policy[B:B + 1], ref[:1], ref[B:B + 1], 0.3, "aot_unpaired", 0.1).losses
    cdpo = pref.dpo_losses(policy[:1], policy[B:B + 1], ref[:1], ref[B:B + 1], 0.3, "sigmoid", 0.1).losses
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
            labels[row, width - pad:] = -100
    return logits, ids, labels


def trl_simpo(logits, ids, labels, beta, gamma, smoothing, cpo_alpha):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trainer = types.SimpleNamespace(
        is_encoder_decoder=False, pad_token_id=0, aux_loss_enabled=False, cpo_alpha=cpo_alpha, loss_type="simpo", alpha=0.0,
        beta=beta, simpo_gamma=gamma, label_smoothing=smoothing, accelerator=_Accelerator())
    for name in ("concatenated_forward", "cpo_loss"):
        setattr(trainer, name, types.MethodType(getattr(CPOTrainer, name), trainer))
    trainer.concatenated_inputs, trainer.get_batch_logps = CPOTrainer.concatenated_inputs, CPOTrainer.get_batch_logps
    batch = {"chosen_input_ids": ids[:B], "chosen_attention_mask": torch.ones_like(ids[:B]), "chosen_labels": labels[:B],
             "rejected_input_ids": ids[B:], "rejected_attention_mask": torch.ones_like(ids[B:]), "rejected_labels": labels[B:]}

    def model(input_ids, **_):
        assert torch.equal(input_ids, ids)
        return types.SimpleNamespace(logits=logits)

    loss, metrics = CPOTrainer.get_batch_loss_metrics(trainer, model, batch)
    return loss, metrics


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("beta, gamma, smoothing, cpo_alpha", [(2.0, 0.5, 0.0, 0.0), (2.5, 1.4, 0.1, 0.0), (0.7, 0.3, 0.0, 1.0)])
def test_simpo_matches_trl_cpo_trainer(beta, gamma, smoothing, cpo_alpha, dtype, tol):
    logits, ids, labels = simpo_batch(dtype)
    trl_loss, metrics = trl_simpo(logits, ids, labels, beta, gamma, smoothing, cpo_alpha)
    (trl_grad,) = torch.autograd.grad(trl_loss, logits)
    sums, counts = pref.answer_logps(logits, labels)
    loss, figures = pref.pair_losses(section("simpo", beta, simpo_gamma=gamma, label_smoothing=smoothing, cpo_alpha=cpo_alpha),
                                     sums, counts, None)
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


@pytest.mark.parametrize("keys, line", [
    ({"loss_type": "hinge", "label_smoothing": 0.1},
     "dpo.label_smoothing: only the sigmoid, robust, exo_pair, aot, aot_unpaired, simpo loss(es) read it (loss_type is 'hinge')"),
    ({"loss_type": "sigmoid", "simpo_gamma": 1.0}, "dpo.simpo_gamma: only the simpo loss(es) read it (loss_type is 'sigmoid')"),
    ({"loss_type": "orpo", "cpo_alpha": 1.0}, "dpo.cpo_alpha: only the simpo loss(es) read it (loss_type is 'orpo')"),
    ({"loss_type": "ipo", "discopop_tau": 0.1}, "dpo.discopop_tau: only the discopop loss(es) read it (loss_type is 'ipo')"),
    ({"loss_type": "exo_pair"}, "dpo.label_smoothing: the exo_pair loss needs it > 0 (EXO suggests 1e-3)"),
    ({"loss_type": "simpo", "precompute_ref_log_probs": True}, "dpo.precompute_ref_log_probs: the simpo loss has no reference model"),
    ({"loss_type": "discopop", "discopop_tau": 0.0}, "dpo.discopop_tau: must be > 0, got 0.0"),
    ({"loss_type": "kto"}, "dpo.loss_type: 'kto' is not one of " + ", ".join(map(repr, pref.LOSS_TYPES))),
])
def test_conflicting_options_are_one_line_each(keys, line):
    assert dpo.DPOSection(**keys).problems() == [line]


@pytest.mark.parametrize("loss_type", pref.LOSS_TYPES)
def test_every_loss_type_with_its_options_is_accepted(loss_type):
    assert dpo.DPOSection(loss_type=loss_type, **OPTIONS.get(loss_type, {})).problems() == []
