"""Scores from a one-output sequence classifier (the reward model), shared by the RM and PPO stages.

Where a reward is read is defined once, by `reward_readout_index`: each row's last attended
token. Every sequence Relay scores ends at the end-of-turn token that closes its response (RM pairs
by construction, `data_formats.render.render_scored`; PPO cuts a response at its first EOS), so RM
training, RM evaluation, the stored reward statistics and PPO all read the same token.
`sequence_scores` runs the classifier's own forward (so DDP/FSDP wrappers see it) and checks that
HF's pooling, which finds the last token through `config.pad_token_id`, lands on that index;
`token_scores` applies the head at every position (PPO's critic needs per-token values).
Positions are counted over attended tokens only, so left and right padding give the same scores.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens (0 at each row's first real token), as `generate`
    uses with left padding; a forward must use the same ones to reproduce its outputs."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def reward_readout_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position a reward is read at: each row's last attended token, for left or right
    padding ([B, T] -> [B]). See the module docstring.

    Raises:
        ValueError: a row attends to nothing.
    """
    if (attention_mask.sum(1) == 0).any():
        raise ValueError("reward_readout_index: a row of the attention mask is all zeros")
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(1).long().argmax(1)


def check_pooling(config, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Check that HF's pooling (the rightmost token that is not `config.pad_token_id`) lands on
    Relay's read-out; nothing to check without a config (a wrapper that hides it).

    Raises:
        ValueError: no pad_token_id, or HF would pool at another token.
    """
    pad = getattr(config, "pad_token_id", 0) if config is not None else None
    if config is not None and pad is None:
        raise ValueError("the reward model's config.pad_token_id is None: its last token cannot be found")
    if pad is not None:
        pooled = (torch.arange(input_ids.shape[1], device=input_ids.device) * (input_ids != pad)).argmax(-1)
        if not torch.equal(pooled, reward_readout_index(attention_mask).to(pooled.device)):
            raise ValueError(
                "sequence_scores: the classifier would pool at another token than the reward read-out "
                "(a sequence ends with the pad id, or the batch is not padded with it)"
            )


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores from the classifier's forward (pooled at the last non-pad token), in fp32.

    Raises:
        ValueError: the model's config has no pad_token_id (HF could not find the last token).
    """
    check_pooling(getattr(model, "config", None), input_ids, attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    return out.logits[:, 0].float()


def classifier_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, score head) of a HF sequence classifier, possibly inside a PeftModel.

    Raises:
        ValueError: the model has no `score` head.
    """
    from peft import PeftModel

    hf = model.get_base_model() if isinstance(model, PeftModel) else model
    head = getattr(hf, "score", None)
    if head is None:
        raise ValueError(f"{type(hf).__name__} has no 'score' head; the reward model must be a sequence classifier")
    return getattr(hf, hf.base_model_prefix), head


def token_scores(classifier: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head applied at every position ([B, T], fp32)."""
    backbone, head = classifier_parts(classifier)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).last_hidden_state
    return head(hidden).squeeze(-1).float()
