"""Scores from a one-output sequence classifier (the reward model), shared by the RM and PPO stages.

The score of a sequence is the `score` head at its last real token. `sequence_scores` uses the
classifier's own forward, which finds that token through `config.pad_token_id` exactly as a plain
`AutoModelForSequenceClassification` consumer does; `token_scores` applies the head at every
position (PPO's critic needs per-token values) and is tested to agree at the last token.
Positions are counted over attended tokens only, so left and right padding give the same scores.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens (0 at each row's first real token), as `generate`
    uses with left padding; a forward must use the same ones to reproduce its outputs."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last attended token, for left or right padding ([B, T] -> [B]).

    Raises:
        ValueError: a row attends to nothing.
    """
    if (attention_mask.sum(1) == 0).any():
        raise ValueError("last_token_index: a row of the attention mask is all zeros")
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(1).long().argmax(1)


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores from the classifier's forward (pooled at the last non-pad token), in fp32.

    Raises:
        ValueError: the model's config has no pad_token_id (HF could not find the last token).
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", 0) is None:
        raise ValueError("the reward model's config.pad_token_id is None: its last token cannot be found")
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
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return head(hidden).squeeze(-1).float()
