"""On-policy distillation's losses (the stage is stages/distill.py): a registry of per-token
divergences between the student's next-token distribution and a frozen teacher's, keyed by
`distill.loss_type`, each computed through the chunked LM head (pipeline.engine.supervised_head
`chunked_rows`), so neither model's `[N, V]` logits exist for more than a chunk of rows.

- `jsd`: the generalized Jensen-Shannon divergence of TRL 1.16's DistillationTrainer
  (trl/trainer/distillation_trainer.py `_chunked_divergence_loss`, the same math as the
  experimental `GKDTrainer.generalized_jsd_loss`): with m = (1 - beta) p_s + beta p_t,
  beta * KL(p_t || m) + (1 - beta) * KL(p_s || m); beta 0 is the forward KL(p_t || p_s), beta 1
  the reverse KL(p_s || p_t); both distributions at `temperature`. With a teacher given as its
  top-k log-probs (`teacher.top_k`, what a served teacher returns), the same divergence over the
  k teacher-chosen tokens plus one tail bucket holding the rest of each distribution's mass; at
  k = V the tail is empty and the divergence is the full one. A teacher on a vLLM server gives the
  same top-k as its prompt log-probs (`served_topk`).
- `reverse_kl_k1`, `reverse_kl_k3`: the reverse KL as a per-token reward on the student's own
  samples (Thinking Machines' on-policy distillation, verl's k1 / low_var_kl k3 estimators, k3
  with verl's clamps):
  the estimate k_t of log p_s(x_t) - log p_t(x_t) is a per-token advantage -k_t (no discount),
  and the loss is the policy gradient k_t * grad log p_s(x_t), whose value is the estimate itself.
  Only the sampled token's log-probs are read, so they need the student's own samples (lmbda 1).

Every entry's loss is token-level over the global batch: the sum over every trained token of the
optimizer step (every micro-batch on every rank) divided by that step's token count, which is
TRL's `num_items_in_batch` reduction.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from pipeline.engine.supervised_head import chunked_rows

# ------------------------------------------------------------------------------------------
# Per-token divergences (pure functions of fp32 log-probs / logits)
# ------------------------------------------------------------------------------------------


def _kl_terms(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """[c] sum_v p_v (log p_v - log q_v); a bucket where p is 0 adds 0 (and no NaN gradient)."""
    live = p_logp > -1e30
    p_safe = torch.where(live, p_logp, torch.zeros_like(p_logp))
    q_safe = torch.where(live, q_logp, torch.zeros_like(q_logp))
    return torch.where(live, p_safe.exp() * (p_safe - q_safe), torch.zeros_like(p_logp)).sum(-1)


def jsd_from_logp(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """[c] generalized JSD of two distributions given as log-probs over the same support [c, S]."""
    if beta == 0:
        return _kl_terms(teacher_logp, student_logp)
    if beta == 1:
        return _kl_terms(student_logp, teacher_logp)
    mixture = torch.logaddexp(student_logp + math.log(1 - beta), teacher_logp + math.log(beta))
    return beta * _kl_terms(teacher_logp, mixture) + (1 - beta) * _kl_terms(student_logp, mixture)


def dense_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """[c] generalized JSD over the whole vocabulary of fp32 logits [c, V] at `temperature`."""
    return jsd_from_logp(
        F.log_softmax(student_logits / temperature, -1), F.log_softmax(teacher_logits / temperature, -1), beta
    )


def teacher_topk(
    teacher_logits: torch.Tensor, k: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher as a served engine reports it: (ids [c, k], log-probs [c, k] at `temperature`,
    the log of the mass outside them [c]; a very negative finite number when nothing is left)."""
    logp = F.log_softmax(teacher_logits / temperature, -1)
    top, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids, top, _outside(logp, ids)


def _outside(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the probability mass of `logp` [c, V] outside `ids` [c, k]. Computed over the
    complement itself (not log(1 - sum)), so an empty tail is exactly zero mass; the fill is finite
    so its gradient is 0, not NaN."""
    floor = torch.finfo(logp.dtype).min
    return logp.scatter(-1, ids, floor).logsumexp(-1).clamp(min=floor)


def topk_jsd(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_tail: torch.Tensor,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    """[c] generalized JSD over the teacher's top-k tokens plus one tail bucket: the student's
    log-probs at `temperature` gathered at `teacher_ids` [c, k] and its mass outside them, against
    the teacher's `teacher_logp` [c, k] and `teacher_tail` [c] (log of its mass outside)."""
    logp = F.log_softmax(student_logits / temperature, -1)
    student = torch.cat([logp.gather(-1, teacher_ids), _outside(logp, teacher_ids).unsqueeze(-1)], -1)
    teacher = torch.cat([teacher_logp, teacher_tail.unsqueeze(-1)], -1)
    return jsd_from_logp(student, teacher, beta)


def sampled_logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c] log p(tokens) under softmax(logits / temperature)."""
    return F.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def k1(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """verl's k1: log p_s - log p_t of the sampled token (unbiased for KL(p_s || p_t), signed)."""
    return student_logp - teacher_logp


K3_LOG_RATIO_CLAMP = 20.0
"""verl's bound on r before exp (verl/trainer/ppo/core_algos.py `kl_penalty_forward`, low_var_kl)."""
K3_CLAMP = 10.0
"""verl's bound on the k3 estimate (the same function)."""


def k3(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """verl's low_var_kl k3 (verl/trainer/ppo/core_algos.py `kl_penalty_forward`): exp(r) - 1 - r
    with r = log p_t - log p_s clamped to [-20, 20], the estimate clamped to [-10, 10] (>= 0, lower
    variance; a token the teacher finds far likelier than the student does costs 10, not e^r)."""
    r = (teacher_logp - student_logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (r.exp() - 1 - r).clamp(-K3_CLAMP, K3_CLAMP)


def reward_form(estimate: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """[c] the policy-gradient loss of the per-token reward -estimate: its value is the estimate,
    its gradient estimate * grad log p_s (the reward is held fixed, as an advantage)."""
    return estimate.detach() * (student_logp - student_logp.detach()).exp()


# ------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------


class Teacher(NamedTuple):
    """The teacher's side of a batch, row for row with the student's: its hidden rows and head
    (in process; head None: rows are logits already), and the per-token options; or, from a
    served teacher, `served`: its top-k (ids [N, k], log-probs [N, k], log of the mass outside [N])."""

    rows: Optional[torch.Tensor]
    head: Optional[torch.nn.Linear]
    top_k: int = 0
    served: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


def served_topk(entries: list[dict[int, float]], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A served teacher's top-k per token as the top-k loss reads it: (ids [N, k], fp32 log-probs
    [N, k], log of the mass outside them [N]) from one {token id: log-prob} of k entries per token.
    The outside mass is 1 - sum(top-k), floored at the smallest normal fp32 (an empty tail).

    Raises:
        ValueError: an entry does not hold exactly k tokens.
    """
    if any(len(e) != k for e in entries):
        raise ValueError(f"a served teacher's position has {min(len(e) for e in entries)} log-probs, not top_k {k}")
    ids = torch.tensor([list(e) for e in entries], dtype=torch.long).view(len(entries), k)
    logp = torch.tensor([list(e.values()) for e in entries], dtype=torch.float64).view(len(entries), k)
    rest = (1.0 - logp.exp().sum(-1)).clamp(min=torch.finfo(torch.float32).tiny)
    return ids, logp.float(), rest.log().float()


class DistillLoss(NamedTuple):
    """A registered distillation loss: `per_token(student_rows, student_head, teacher, tokens,
    beta, temperature)` -> [N] fp32 (differentiable in the student), the `distill` options it reads
    besides temperature, whether it needs the student's own samples (every batch on-policy), and
    whether it can score against the teacher's top-k alone (`teacher.top_k`, a served teacher)."""

    per_token: Callable[..., torch.Tensor]
    options: tuple[str, ...] = ()
    on_policy_only: bool = False
    reads_top_k: bool = False
    doc: str = ""


def _teacher_logits(teacher: Teacher, rows: torch.Tensor) -> torch.Tensor:
    if teacher.head is None:
        return rows.float()
    with torch.no_grad():
        w, b = teacher.head.weight, teacher.head.bias
        return F.linear(rows.to(w.dtype), w, b).float()


def _jsd_rows(
    student: torch.Tensor, head, teacher: Teacher, tokens: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    def chunk(logits: torch.Tensor, teacher_rows: torch.Tensor) -> torch.Tensor:
        target = _teacher_logits(teacher, teacher_rows)
        if teacher.top_k:
            return topk_jsd(logits, *teacher_topk(target, teacher.top_k, temperature), beta, temperature)
        return dense_jsd(logits, target, beta, temperature)

    if teacher.served is not None:  # the top-k a server reported (at temperature 1: the config checks)
        ids, logp, tail = (t.to(student.device) for t in teacher.served)
        return chunked_rows(
            lambda logits, *top: topk_jsd(logits, *top, beta, temperature), student, head, ids, logp, tail
        )
    return chunked_rows(chunk, student, head, teacher.rows)


def _reward_rows(estimator: Callable) -> Callable[..., torch.Tensor]:
    def rows(
        student: torch.Tensor, head, teacher: Teacher, tokens: torch.Tensor, beta: float, temperature: float
    ) -> torch.Tensor:
        def chunk(logits: torch.Tensor, teacher_rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            own = sampled_logp(logits, ids, temperature)
            target = sampled_logp(_teacher_logits(teacher, teacher_rows), ids, temperature)
            return reward_form(estimator(own, target), own)

        return chunked_rows(chunk, student, head, teacher.rows, tokens)

    return rows


LOSSES: dict[str, DistillLoss] = {
    "jsd": DistillLoss(
        _jsd_rows, options=("beta",), reads_top_k=True, doc="TRL's generalized JSD (beta 0: forward KL, 1: reverse KL)"
    ),
    "reverse_kl_k1": DistillLoss(_reward_rows(k1), on_policy_only=True, doc="reverse KL as a per-token reward, k1"),
    "reverse_kl_k3": DistillLoss(_reward_rows(k3), on_policy_only=True, doc="reverse KL as a per-token reward, k3"),
}
"""`distill.loss_type` -> its DistillLoss."""
LOSS_TYPES = tuple(LOSSES)


def per_token_losses(
    loss_type: str,
    student: torch.Tensor,
    head: Optional[torch.nn.Linear],
    teacher: Teacher,
    tokens: torch.Tensor,
    *,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    """[N] each trained token's loss: `student` [N, H] hidden rows under `head` (None: logits
    [N, V]), `teacher` the same rows of the teacher, `tokens` [N] the tokens at those positions.

    Raises:
        KeyError: an unknown loss_type (the config check refuses it first).
    """
    return LOSSES[loss_type].per_token(student, head, teacher, tokens, beta, temperature)


def global_token_loss(per_token: torch.Tensor, num_items: torch.Tensor | float) -> torch.Tensor:
    """The token-level reduction over the global batch: this micro-batch's share, sum / the step's
    trained tokens on every rank (TRL's `num_items_in_batch`)."""
    return per_token.sum() / num_items
