"""Scoring forwards that run a batch's shared opening once.

The rows of an RL batch are [left-padded prompt | response], and chat prompts open with the same
tokens: the template's system turn and the user turn's header (24 of the demo's ~40-token PPO
prompts under SmolLM2's template). `find_opening` moves each row's padding after that opening
([opening | padding | own prompt | response]); positions count real tokens and the mask hides the
padding wherever it sits, so every row computes what it computed before. The opening then runs
on one row; a KV cache copied to every row (`index_select`, whose backward sums the rows'
gradients into that one computation) carries it, and the rest of each row runs on that cache.
The same math as the whole rows, in another summation order (~1e-6 in fp32), with or without
gradients. What changes: LoRA dropout in the opening is drawn once for the batch instead of per
row, as GRPO's shared prompts already are (pipeline.rl.rollout.shared_prompt_logits);
the RL stages train without dropout, so only the RM's draws differ.

Who uses it: `find_opening` relays the RL stages' [left-padded prompt | response] rows (PPO's
policy, reference, critic and reward forwards, GRPO's reward); `leading_opening` takes right-padded
rows as they are (the RM's pairs, in one process: `opening_sequence_scores`). The response columns
keep their place (the relayout moves prompt columns only), so the callers' slices of logits and
scores are unchanged. The decode engine lays out its prompts the same way
(pipeline.modeling.decode.prompt_layout). Issue 33, the demo's stages capped to AVX2, back to back:
PPO 182.3 -> 169.4 / 165.8 s (eval rewards equal to 4 decimals), RM 77.8 -> 58.7 s (held-out
accuracy 1.0 both, margin 2.505 / 2.510: the dropout draws).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from data_formats.collate import common_prefix
from pipeline.modeling.decode import SHARED_PREFIX_MIN, cache_keyword
from pipeline.modeling.decode_steps import hf_model
from pipeline.modeling.scoring import (
    check_pooling,
    classifier_parts,
    position_ids_from_mask,
    reward_readout_index,
    token_scores,
)


class Opening(NamedTuple):
    """A batch relaid so that its rows' shared opening fills the first `shared` columns."""

    shared: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def held_in_shards(model: torch.nn.Module) -> bool:
    """Whether an engine holds `model`'s weights in shards: FSDP2 units (what
    pipeline.engine.fsdp.is_sharded asks; asked here by type, since the model layer sits below the
    engine) or ZeRO-3 partitions (a DeepSpeed parameter carries a `ds_id`)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules()) or hasattr(next(model.parameters(), None), "ds_id")


def prompt_sharing_allowed(model: torch.nn.Module) -> bool:
    """A forward that keeps a KV cache and runs twice before its backward: not on a model under
    gradient checkpointing, nor on weights an engine holds in shards (FSDP2, ZeRO-3: they are
    gathered for one forward and freed after it).

    Gradient checkpointing's training forwards cannot keep a cache (transformers drops it, since
    the backward replays each layer), so none of the model's forwards shares, with gradients or
    without: an RL update must compute what its scoring pass computed, and the policy's log-probs
    what its reference's did, bit for bit (the first ratio 1, the first KL 0); a shared opening is
    the same sum in another order, which rounds differently (most in bf16)."""
    if held_in_shards(model):
        return False
    hf = hf_model(model)
    checkpointing = getattr(hf, "is_activation_checkpointing", None)  # transformers >= 5.2x; the old name warns
    checkpointing = checkpointing if checkpointing is not None else getattr(hf, "is_gradient_checkpointing", False)
    return not checkpointing


def cache_usable(model: torch.nn.Module, rows: int) -> bool:
    """Whether `model` can run an opening once for `rows` rows: several rows, an attention that takes
    any mask (sdpa, eager; not flash attention's packed sequences) and `prompt_sharing_allowed`."""
    return (
        rows > 1 and hf_model(model).config._attn_implementation in ("sdpa", "eager") and prompt_sharing_allowed(model)
    )


def find_opening(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int
) -> Optional[Opening]:
    """The batch relaid [opening | padding | own prompt | response] when its rows' prompts (the
    left-padded first `prompt_width` columns) all open with the same >= SHARED_PREFIX_MIN tokens,
    each keeping at least one token of its own; None when they do not, when the prompt block is not
    left-padded, or when the model cannot take the cache (`cache_usable`)."""
    rows, P = input_ids.shape[0], prompt_width
    if not cache_usable(model, rows):
        return None
    block = attention_mask[:, :P].long()
    starts = P - block.sum(1)
    cols = torch.arange(P, device=input_ids.device)
    if not torch.equal(block, (cols[None] >= starts[:, None]).long()):
        return None
    shared = common_prefix([row[s:].tolist() for row, s in zip(input_ids[:, :P].cpu(), starts.tolist())])
    if shared < SHARED_PREFIX_MIN:
        return None
    c, s = cols[None].expand(rows, P), starts[:, None]
    # a relaid column: the opening (from after the padding), then the padding, then the rest in place
    order = torch.where(c < shared, c + s, torch.where(c < shared + s, c - shared, c))
    relaid = lambda t: torch.cat([t[:, :P].gather(1, order), t[:, P:]], 1)  # noqa: E731
    return Opening(shared, relaid(input_ids), relaid(attention_mask))


def leading_opening(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Optional[Opening]:
    """The batch as it is when its rows start in the same >= SHARED_PREFIX_MIN attended tokens, each
    keeping at least one of its own after them (right-padded sequences of one chat template, as the
    RM's pairs); None otherwise, or when the model cannot take the cache (`cache_usable`)."""
    if not cache_usable(model, input_ids.shape[0]):
        return None
    lengths = attention_mask.long().sum(1)
    if int(lengths.min()) <= SHARED_PREFIX_MIN or not bool(attention_mask[:, :SHARED_PREFIX_MIN].all()):
        return None
    shared = common_prefix([row[:n].tolist() for row, n in zip(input_ids.cpu(), lengths.tolist())])
    if shared < SHARED_PREFIX_MIN or not bool(attention_mask[:, :shared].all()):
        return None
    return Opening(shared, input_ids, attention_mask)


def cached_run(call, forward: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, config):
    """(`call(**inputs)`'s output on these rows, the KV cache it filled), positions counted from the
    mask. `forward` is the module whose signature names the cache keyword. The prefix forward of
    `opening_cache` and of GRPO's shared prompts (pipeline.rl.rollout.shared_prompt_logits)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    out = call(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=True,
        **{cache_keyword(forward): cache},
    )
    return out, cache


def opening_cache(call, forward: torch.nn.Module, opening: Opening, config):
    """A KV cache holding the opening, run once by `call(**inputs)` on the first row, for every row."""
    n = opening.shared
    _, cache = cached_run(call, forward, opening.input_ids[:1, :n], opening.attention_mask[:1, :n], config)
    cache.reorder_cache(torch.zeros(opening.input_ids.shape[0], dtype=torch.long, device=opening.input_ids.device))
    return cache


def opening_logits(model: torch.nn.Module, opening: Opening, prompt_width: int) -> torch.Tensor:
    """A causal LM's logits predicting each response token ([B, R, V], as
    pipeline.rl.rollout.policy_logits), the opening run once; its final hidden states
    ([B, R, H]) with the head swapped for the identity (rollout.policy_logprobs' chunked head)."""
    n, T = opening.shared, opening.input_ids.shape[1]
    cache = opening_cache(lambda **kw: model(**kw, logits_to_keep=1), model, opening, hf_model(model).config)
    mask = opening.attention_mask[:, : T - 1]
    return model(
        input_ids=opening.input_ids[:, n : T - 1],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, n:],
        use_cache=True,
        logits_to_keep=T - prompt_width,
        **{cache_keyword(model): cache},
    ).logits


def opening_hidden(classifier: torch.nn.Module, opening: Opening) -> torch.Tensor:
    """The classifier backbone's last hidden states after the opening ([B, T - shared, H]), the
    opening run once."""
    backbone, _ = classifier_parts(classifier)
    n, mask = opening.shared, opening.attention_mask
    cache = opening_cache(backbone, backbone, opening, hf_model(classifier).config)
    return backbone(
        input_ids=opening.input_ids[:, n:],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, n:],
        use_cache=True,
        **{cache_keyword(backbone): cache},
    ).last_hidden_state


def opening_sequence_scores(
    classifier: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> Optional[torch.Tensor]:
    """pipeline.modeling.scoring.sequence_scores (the [B] scores read at each row's last token, with
    its check of HF's pooling) with the rows' shared opening run once (`leading_opening`); None when
    they have none. It calls the backbone and head, not the classifier's forward: for a model no
    engine wraps (one process)."""
    opening = leading_opening(classifier, input_ids, attention_mask)
    if opening is None:
        return None
    check_pooling(classifier.config, input_ids, attention_mask)
    hidden = opening_hidden(classifier, opening)
    at = reward_readout_index(attention_mask) - opening.shared
    _, head = classifier_parts(classifier)
    return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), at]).squeeze(-1).float()


def response_scores(
    classifier: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int
) -> torch.Tensor:
    """The score head at the last prompt column and every response column ([B, T - P + 1], fp32):
    `token_scores(...)[:, P - 1:]`, the batch's shared opening run once when it has one."""
    opening = find_opening(classifier, input_ids, attention_mask, prompt_width)
    if opening is None:
        return token_scores(classifier, input_ids, attention_mask)[:, prompt_width - 1 :]
    _, head = classifier_parts(classifier)
    return head(opening_hidden(classifier, opening)[:, prompt_width - 1 - opening.shared :]).squeeze(-1).float()
