"""A stage's checks before any heavy work (Stage.validate gathers them with the config's own and
the data paths' from data_formats.validate): the parent model folder and its manifest, and whether
the training set supervises any token. Pure functions of their inputs; each returns one line per problem."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from data_formats.sampling import SourceMix
from pipeline.modeling.handoff import manifest_problems
from pipeline.modeling.preflight import model_problems


def fill_problem(
    count: int,
    what: str,
    batch: str,
    size: int,
    world: int,
    drops: Optional[dict] = None,
    mix: Optional[SourceMix] = None,
) -> list[str]:
    """The one line when `count` training items cannot fill one batch of `size` on each of `world`
    ranks, with the reason when the build dropped records as overlong (`drops`,
    data_formats.drops.overlong_drops): a reason in a warning above the line is missed. With a
    weighted mix (`mix`), a weighted entry that yields nothing is such a line too, naming it, and so
    is an entry too small for data.mix_stop first_exhausted to fill one batch per epoch."""
    drops = drops or {}
    if count < size * world:
        line = f"data.train: {count} {what} cannot fill one {batch} of {size} x {world} rank(s)"
        reason = overlong_reason(drops)
        return [f"{line}: {reason}" if reason else line]
    if mix is None:
        return []
    empty = [k for k, n in enumerate(mix.sizes) if n == 0]
    if empty:
        parts = []
        for k in empty:
            reason = overlong_reason(
                {**drops, "by_entry": {mix.names[k]: drops.get("by_entry", {}).get(mix.names[k], [0, 0])}}
            )
            parts.append(
                f"{mix.names[k]} (weight {mix.weights[k]:.3g}) yields 0 {what}" + (f": {reason}" if reason else "")
            )
        return ["data.weights: " + "; ".join(parts) + " (a weighted entry must give samples)"]
    if mix.shortest_epoch() < size * world:
        k = mix.sizes.index(min(mix.sizes))
        return [
            f"data.weights: {mix.names[k]} gives {mix.sizes[k]} {what}, fewer than one {batch} of {size} x {world} "
            f"rank(s), so a data.mix_stop first_exhausted epoch can end before one is filled; use all_exhausted "
            f"or a number of samples"
        ]
    return []


def early_stopping_problems(train, has_eval: bool, evaluates_loss: bool) -> list[str]:
    """Why train.early_stopping_stall_num (MFTCoder's) could never fire: no evaluations, no held-out
    data, or a stage whose evaluation has no eval/loss to watch."""
    if not train.early_stopping_stall_num:
        return []
    key = "train.early_stopping_stall_num"
    if not evaluates_loss:
        return [f"{key}: this stage's evaluation has no eval/loss to watch (its held-out figures are rewards)"]
    if not train.eval_steps:
        return [f"{key}: needs evaluations, and train.eval_steps is 0"]
    if not has_eval:
        return [f"{key}: needs held-out data (data.eval or data.eval_fraction)"]
    return []


def overlong_reason(drops: dict) -> str:
    """'N dropped as longer than train.seq_length L (the longest M tokens); ...' per data entry
    when several, with the settings that keep them; '' when nothing was dropped. drops' `limits`
    are the settings that bound an item's length, by key (a prompt's: data.max_prompt_length and
    train.seq_length - generation.max_new_tokens), its `shorten` what data.truncation 'truncate'
    does (data_formats.drops.note_overlong)."""
    by_entry = {entry: counts for entry, counts in drops.get("by_entry", {}).items() if counts[0]}
    if not by_entry:
        return ""
    limits = drops["limits"]
    key = min(limits, key=limits.get)
    parts = [
        f"{count} dropped as longer than {key} {limits[key]} (the longest {longest} tokens)"
        for count, longest in by_entry.values()
    ]
    if len(by_entry) > 1:
        parts = [f"{entry}: {part}" for entry, part in zip(by_entry, parts)]
    longest = max(longest for _, longest in by_entry.values())
    short = [k for k, limit in limits.items() if limit < longest]
    keep = f"{' and '.join(short)}: {longest} " + ("keeps them" if len(short) == 1 else "keep them")
    if drops.get("truncation") == "drop":
        keep += ", " + drops.get("shorten", "data.truncation: truncate shortens them to fit")
    return "; ".join(parts) + f"; {keep}"


def parent_problems(model_path: str, need: str = "causal", allow_pickle: bool = False) -> list[str]:
    """What keeps model.path from loading as a `need` model (pipeline.modeling.preflight: missing,
    an adapter or reward-model folder, no weights/tokenizer, an unreachable hub id), then
    mismatches between a local parent model's manifest and its folder's tokenizer/template."""

    found = model_problems(model_path, "model.path", need=need, allow_pickle=allow_pickle)
    folder = Path(model_path)
    if found or not folder.is_dir():
        return found
    return [f"model.path: {p}" for p in manifest_problems(folder, required=False)]


def supervision_problems(samples: Sequence, seq_length: int) -> list[str]:
    """A training set whose every label is masked trains nothing (its loss is 0): say so. Only
    samples with `labels` count (PT and SFT rows; pairs and prompts have none)."""
    labelled = [s["labels"] for s in samples if isinstance(s, dict) and "labels" in s]
    if labelled and not any(bool(torch.as_tensor(labels).ne(-100).any()) for labels in labelled):
        return [
            f"data.train: no training sample has a token to learn (every label is masked; train.seq_length "
            f"{seq_length} may be too short for the prompts)"
        ]
    return []
