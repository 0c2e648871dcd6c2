"""The policy side shared by the RL stages (PPO, GRPO), after generation (pipeline/rl/generators.py):
turning generated ids into padded batches with response masks (`Rollout`), the
response tokens' log-probs and entropies (`policy_logprobs`, through the chunked LM head: no
[B, R, V] logits) or logits (`policy_logits`) and the two-backbone actor-critic module. PPO's scoring
and update are pipeline/rl/ppo.py, GRPO's pipeline/rl/grpo.py.

Memory design (LoRA/QLoRA): the policy is a LoRA on the SFT model and the reference policy is the
same backbone with the adapter disabled; the critic is a LoRA plus a copy of the RM's `score`
head on the RM backbone, and the reward is the same backbone with the adapter (and so the head
copy) disabled. Two backbones instead of four. With full fine-tuning the reference and reward are
separate frozen copies.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from data_formats.collate import left_pad
from pipeline.algorithms.rl import entropy_from_logits, logprobs_from_logits
from pipeline.engine.supervised_head import head_split, hidden_states_as_logits, sampled_token_logps
from pipeline.modeling.decode import cache_keyword
from pipeline.modeling.decode_steps import hf_model
from pipeline.modeling.models import adapter_disabled
from pipeline.modeling.opening import cached_run, find_opening, opening_logits, prompt_sharing_allowed, response_scores
from pipeline.modeling.scoring import position_ids_from_mask, reward_readout_index

log = logging.getLogger("relay.rollout")


def cut_at_eos(response: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """The response up to and including its first EOS, and whether it had one (finished).

    `generate` keeps emitting padding after a row finishes; everything after the first EOS is
    dropped here so padding can never be mistaken for content.
    """
    for i, token in enumerate(response):
        if token in eos_ids:
            return list(response[: i + 1]), True
    return list(response), False


@dataclass
class Rollout:
    """One batch of prompts and sampled responses, laid out as [left-padded prompt | right-padded
    response] so every response starts at column `prompt_width`."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R]: 1 on response tokens (EOS included)
    prompt_width: int
    finished: torch.Tensor  # [B] bool: the response ended with EOS
    responses: list[list[int]]
    conversations: Optional[list[list[dict]]] = None
    """Tool rollouts: each row's completion as messages (assistant turns with their `tool_calls`,
    the `tool` results), what the reward functions receive (pipeline/rl/tool_rollout.py)."""
    tool_calls: Optional[list[tuple[int, int]]] = None
    """Tool rollouts: each row's (calls answered with a result, of them failed: an error text)."""
    engine_logp: Optional[torch.Tensor] = None
    """[B, R]: the sampling engine's own log-prob of each response token, when it gives them
    (vLLM: pipeline/algorithms/mismatch.py compares them with the trainer's); NaN on padding."""

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]


def assemble(
    prompts: Sequence[Sequence[int]], raw_responses: Sequence[Sequence[int]], pad_id: int, eos_ids: Sequence[int]
) -> Rollout:
    """Build a Rollout from prompts and raw generated ids (cut at the first EOS).

    Raises:
        ValueError: counts differ, or a response is empty.
    """
    if len(prompts) != len(raw_responses):
        raise ValueError(f"assemble: {len(prompts)} prompts but {len(raw_responses)} responses")
    cut = [cut_at_eos(r, eos_ids) for r in raw_responses]
    responses = [ids for ids, _ in cut]
    return assemble_masked(prompts, responses, [[1] * len(r) for r in responses], [f for _, f in cut], pad_id)


def assemble_masked(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    trained: Sequence[Sequence[int]],
    finished: Sequence[bool],
    pad_id: int,
    conversations: Optional[list[list[dict]]] = None,
) -> Rollout:
    """A Rollout from whole responses and their per-token train masks (1: sampled by the policy,
    0: inserted, as a tool rollout's results): every token is attended, only the 1s train.

    Raises:
        ValueError: a response is empty, or a mask's length is not its response's.
    """
    if any(not r for r in responses):
        raise ValueError("assemble: a generated response is empty (max_new_tokens must be >= 1)")
    if any(len(r) != len(m) for r, m in zip(responses, trained)):
        raise ValueError("assemble: a train mask's length differs from its response's")
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(len(r) for r in responses)
    resp = torch.full((len(responses), width), pad_id, dtype=torch.long)
    attend = torch.zeros((len(responses), width), dtype=torch.long)
    train = torch.zeros((len(responses), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(zip(responses, trained)):
        resp[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attend[row, : len(ids)] = 1
        train[row, : len(ids)] = torch.tensor(mask, dtype=torch.long)
    return Rollout(
        input_ids=torch.cat([prompt_ids, resp], 1),
        attention_mask=torch.cat([prompt_mask, attend], 1),
        response_mask=train,
        prompt_width=prompt_ids.shape[1],
        finished=torch.tensor(list(finished), dtype=torch.bool),
        responses=[list(r) for r in responses],
        conversations=conversations,
    )


def take_rows(picks: Sequence[tuple[Rollout, int]], prompts: Sequence[Sequence[int]], pad_id: int) -> Rollout:
    """Rows of several rollouts, `picks` as (rollout, row), laid out as one Rollout with each row's
    response, train mask, finished flag, conversation and tool calls as sampled (GRPO's dynamic sampling keeps
    some groups of several generation batches; a tool rollout's inserted results stay untrained)."""
    responses = [ro.responses[i] for ro, i in picks]
    trained = [ro.response_mask[i, : len(ro.responses[i])].tolist() for ro, i in picks]
    finished = [bool(ro.finished[i]) for ro, i in picks]
    conversations = None
    if all(ro.conversations is not None for ro, _ in picks):
        conversations = [ro.conversations[i] for ro, i in picks]
    out = assemble_masked(prompts, responses, trained, finished, pad_id, conversations)
    if all(ro.tool_calls is not None for ro, _ in picks):
        out.tool_calls = [ro.tool_calls[i] for ro, i in picks]
    if all(ro.engine_logp is not None for ro, _ in picks):
        out.engine_logp = torch.full(out.response_mask.shape, float("nan"))
        for row, (ro, i) in enumerate(picks):
            out.engine_logp[row, : len(ro.responses[i])] = ro.engine_logp[i, : len(ro.responses[i])]
    return out


def policy_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    share: bool = True,
) -> torch.Tensor:
    """Logits predicting each response token ([B, R, V]); position t-1 predicts token t.

    `logits_to_keep` makes the LM head skip the prompt positions: with a 49k vocabulary the
    head's [B, T, V] output is most of a small model's compute and memory. Rows that share their
    prompt (GRPO's groups) run it once (`shared_prompt_logits`); rows whose prompts open alike
    (a chat template's system turn) run that opening once (pipeline.modeling.opening); neither
    when `share` is False (whole rows, what a model that cannot share computes).
    """
    groups = prompt_groups(input_ids, attention_mask, prompt_width) if share else None
    if groups is not None and prompt_sharing_allowed(model):
        return shared_prompt_logits(model, input_ids, attention_mask, prompt_width, *groups)
    opening = find_opening(model, input_ids, attention_mask, prompt_width) if share else None
    if opening is not None:
        return opening_logits(model, opening, prompt_width)
    keep = input_ids.shape[1] - prompt_width + 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=keep,
    )
    return out.logits[:, :-1]


class PolicyOut(NamedTuple):
    """The policy's side of an RL forward at the sampling temperature (`policy_logprobs`)."""

    logp: torch.Tensor
    """[B, R] fp32 log-prob of each response token, differentiable."""
    entropy: Optional[torch.Tensor] = None
    """[B, R] fp32 entropy of each position's distribution, without gradient; None unless asked."""


_FULL_LOGITS = False
"""Private switch: True takes the full-vocabulary logits path everywhere (bench/rl_memory.py's
'before' side); the chunked head is the path wherever `head_split` allows it."""


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    temperature: float,
    entropy: bool = False,
    like: Optional[torch.nn.Module] = None,
) -> PolicyOut:
    """log p(token) of each response token under softmax(logits / temperature) in fp32 (and each
    position's entropy when `entropy`), as `rl.logprobs_from_logits(policy_logits(...).float() /
    temperature, ...)` computes them, without the [B, R, V] logits: the backbone's hidden states
    at the response positions (`policy_logits`' forwards with the head swapped for the identity:
    shared prompts and openings run once as there) go through the LM head in chunks of rows
    (pipeline.engine.supervised_head.sampled_token_logps), whose backward recomputes each chunk.
    Where the chunked head is not exact or safe (`head_split`: a LoRA'd or post-processed head,
    weights an engine shards) the full logits run as before.

    `like`: a model whose path this forward takes (openings shared and the chunked head only where
    `like` may use them too), so that two models with equal weights give equal log-probs: a frozen
    reference beside a policy an engine shards (which shares nothing and runs the full head)."""
    tokens = input_ids[:, prompt_width:]
    head = None if _FULL_LOGITS else head_split(model)
    if like is not None and head is not None and head_split(like) is None:
        head = None
    share = prompt_sharing_allowed(model if like is None else like)
    if head is None:
        logits = policy_logits(model, input_ids, attention_mask, prompt_width, share).float() / temperature
        logp = logprobs_from_logits(logits, tokens)
        if not entropy:
            return PolicyOut(logp)
        with torch.no_grad():
            return PolicyOut(logp, entropy_from_logits(logits))
    with hidden_states_as_logits(model, head):
        hidden = policy_logits(model, input_ids, attention_mask, prompt_width, share)  # [B, R, H]
    logp, ent = sampled_token_logps(
        hidden.reshape(-1, hidden.shape[-1]), head, tokens.reshape(-1), temperature, entropy
    )
    return PolicyOut(logp.view(tokens.shape), None if ent is None else ent.view(tokens.shape))


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(one row of each distinct prompt [U], each row's index into those [B]) when some rows share
    their prompt (the same ids and mask in the first `prompt_width` columns); None when none do."""
    rows = input_ids.shape[0]
    prompts = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width].to(input_ids.dtype)], 1)
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    if unique.shape[0] == rows:
        return None
    first = torch.full((unique.shape[0],), rows, dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(rows, device=input_ids.device), reduce="amin")
    return first, inverse


def shared_prompt_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    first: torch.Tensor,
    inverse: torch.Tensor,
) -> torch.Tensor:
    """`policy_logits` with each distinct prompt run once: the prompts' forward fills a KV cache,
    which is then indexed out to every row of the prompt's group, and the responses run on it. The
    same math as one forward of the whole rows (another summation order: ~1e-6 in fp32); with
    gradients on, every row's gradient flows into the shared prompt's activations."""
    P, T = prompt_width, input_ids.shape[1]
    out, cache = cached_run(
        lambda **kw: model(**kw, logits_to_keep=1),
        model,
        input_ids[first, :P],
        attention_mask[first, :P],
        hf_model(model).config,
    )
    head = out.logits[:, -1]  # [U, V]: predicts response token 0
    logits = head.index_select(0, inverse)[:, None]
    if T - P > 1:
        cache.reorder_cache(inverse)
        mask = attention_mask[:, : T - 1]
        rest = model(
            input_ids=input_ids[:, P : T - 1],
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask)[:, P:],
            use_cache=True,
            **{cache_keyword(model): cache},
        ).logits
        logits = torch.cat([logits, rest], 1)
    return logits


class ActorCritic(torch.nn.Module):
    """Policy and critic as one module, so accelerate/DDP wrap (and sync) both in one forward.

    `reference`/`reward` None means "the same backbone with its adapter disabled" (LoRA modes).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        critic: torch.nn.Module,
        reference: Optional[torch.nn.Module] = None,
        reward: Optional[torch.nn.Module] = None,
    ):
        super().__init__()
        self.policy, self.critic = policy, critic
        # Plain attributes, not submodules: frozen copies must stay out of parameters(),
        # state_dict() and the optimizer.
        self.__dict__["reference"] = reference
        self.__dict__["reward"] = reward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_width: int,
        policy: bool = True,
        critic: bool = True,
        *,
        temperature: Optional[float] = None,
        entropy: bool = False,
    ) -> tuple[Optional[torch.Tensor | PolicyOut], Optional[torch.Tensor]]:
        """(policy, values [B, R]) for the R response tokens: position t-1 predicts token t.

        With a `temperature` the policy's part is a `PolicyOut` (log-probs of the response tokens,
        entropies when `entropy`) computed without the full-vocabulary logits (`policy_logprobs`),
        what the RL updates and scoring use; without, the logits [B, R, V]. The head runs inside
        this forward either way, so an engine wrapping the module sees it.
        `policy=False` / `critic=False` skips that model (its result is None).
        """
        out = None
        if policy and temperature is not None:
            out = policy_logprobs(self.policy, input_ids, attention_mask, prompt_width, temperature, entropy)
        elif policy:
            out = policy_logits(self.policy, input_ids, attention_mask, prompt_width)
        values = response_scores(self.critic, input_ids, attention_mask, prompt_width)[:, :-1] if critic else None
        return out, values

    @torch.no_grad()
    def reference_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int, temperature: float
    ) -> torch.Tensor:
        """log p_ref of each response token ([B, R])."""
        model = self.reference if self.reference is not None else self.policy
        ctx = contextlib.nullcontext() if self.reference is not None else adapter_disabled(self.policy)
        # fp32 before the division (policy_logprobs): bf16 logits divided in bf16 round differently
        # from the policy's own log-probs, a KL between identical models at step 0; and the
        # policy's path (a frozen copy beside a sharded policy would share openings and use the
        # chunked head where the policy cannot), for the same reason.
        with ctx:
            return policy_logprobs(model, input_ids, attention_mask, prompt_width, temperature, like=self.policy).logp

    @torch.no_grad()
    def reward_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
        """The reward model's score of each whole sequence ([B]), read at its last real token (a
        response's: `prompt_width` columns of prompt come first).

        Raises:
            ValueError: a row ends inside its prompt (an empty response).
        """
        model = self.reward if self.reward is not None else self.critic
        ctx = contextlib.nullcontext() if self.reward is not None else adapter_disabled(self.critic)
        at = reward_readout_index(attention_mask) - (prompt_width - 1)
        if (at < 1).any():
            raise ValueError("reward_scores: a row has no response token to read its reward at")
        with ctx:
            scores = response_scores(model, input_ids, attention_mask, prompt_width)
        return scores[torch.arange(scores.shape[0]), at]


def chunks(n: int, size: int) -> list[slice]:
    """Row slices of at most `size` covering range(n) (the micro-batches of a scoring pass)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
