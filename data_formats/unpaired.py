"""Unpaired preference data (the KTO stage, stages/kto.py): one answer per record, labelled
desirable (true) or undesirable (false). The validator's kind is `kto` (data_formats.validate);
records are read by data_formats.records.parse_unpaired through the format registry.

Layouts read (the label must be a JSON true/false):
- TRL's unpaired preference type (KTOTrainer): standard {"prompt": str, "completion": str,
  "label": bool}; conversational {"prompt": [messages], "completion": [messages], "label": bool}.
- LLaMA-Factory's (data/kto_en_demo.json; its dataset_info maps the `kto_tag` column to `label`):
  {"messages": [...], "label": bool} or sharegpt {"conversations": [{from, value}], "kto_tag": bool};
  the last assistant answer is the one judged, the turns before it its prompt.
- Paired records ({prompt, chosen, rejected} and the other RM layouts), which TRL's KTOTrainer
  unpairs: the chosen answer desirable, the rejected one undesirable (two samples). As TRL's
  `unpair_preference_dataset` orders them, every record's first sample comes first, then every
  record's second: the two answers to one prompt are never neighbours in a sequential batch.

A sample is dict(input_ids, prompt_len, label (1 desirable, 0 not), record, source): the rendered prompt followed by
the answer up to and including its end-of-turn token, as DPO renders a side (`render_scored`); an
overlong sample loses its oldest prompt tokens (truncation='truncate', at least one kept) or is
dropped. `record` numbers the records of the split: the two samples of a pair share it.

KTO's KL rows (`kl_partners`, `mismatched_rows`) pair each sample's prompt with the answer of a
sample that answers another question: never its own record's other side, nor an answer to the same
prompt text. An answer to the same question is no sample of the mismatched distribution the KL
baseline z_ref estimates, and would bias it towards the matched rewards it is subtracted from.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional, Sequence

from tqdm.auto import tqdm

from data_formats.collate import IGNORE_INDEX
from data_formats.datasets import split_records, through_cache
from data_formats.drops import warn_drops
from data_formats.render import Template, render_scored
from data_formats.sources import Problem
from data_formats.token_cache import Built, Check

log = logging.getLogger(__name__)


def fit_unpaired(
    prompt: list[int], answer: list[int], seq_length: int, truncate: bool
) -> Optional[tuple[list[int], int]]:
    """(prompt + answer ids, prompt tokens kept) within `seq_length`, cutting the oldest prompt
    tokens when `truncate`; None when it does not fit (or the answer leaves no room for a prompt token)."""
    if len(prompt) + len(answer) <= seq_length:
        return prompt + answer, len(prompt)
    keep = seq_length - len(answer)
    if not truncate or keep < 1:
        return None
    return prompt[len(prompt) - keep :] + answer, keep


def unpaired_samples(
    records, tokenizer, template: Template, seq_length: int, truncation: str, split: str, check: Check
) -> Built:
    """The samples (module docstring) of validated `kto` records, with info: the counts logged."""
    out: list[dict] = []
    problems: list[Problem] = []
    counts = {"desirable": 0, "undesirable": 0, "dropped_overlong": 0, "truncated": 0}
    sides: list[list[dict]] = [[], []]  # TRL's unpairing order: first sides, then second sides
    for number, record in enumerate(tqdm(records, desc=f"tokenizing kto {split}", disable=len(records) < 1000)):
        for side, (conv, label) in enumerate(record.value):
            try:
                prompt, answer = render_scored(conv, tokenizer, template)
            except ValueError as err:  # the template cannot render this record
                problems.append(Problem(record.file, record.line, str(err)))
                continue
            fitted = fit_unpaired(prompt, answer, seq_length, truncation == "truncate")
            if fitted is None:
                counts["dropped_overlong"] += 1
                continue
            counts["truncated"] += fitted[1] < len(prompt)
            counts["desirable" if label else "undesirable"] += 1
            # label as 1/0: the token cache stores int columns, not bools
            sides[side].append(
                {
                    "input_ids": fitted[0],
                    "prompt_len": fitted[1],
                    "label": int(label),
                    "record": number,
                    "source": record.source,
                }
            )
    out = sides[0] + sides[1]
    check(problems, f"kto {split} data")
    return Built(out, counts)


def answer_rows(samples: list[dict]) -> list[dict]:
    """Collator rows (input_ids, labels on the answer tokens) of unpaired samples."""
    return [
        {"input_ids": s["input_ids"], "labels": [IGNORE_INDEX] * s["prompt_len"] + s["input_ids"][s["prompt_len"] :]}
        for s in samples
    ]


def _question(sample: dict) -> tuple[int, tuple[int, ...]]:
    return sample["record"], tuple(sample["input_ids"][: sample["prompt_len"]])


def _other_question(a: tuple, b: tuple) -> bool:
    """Whether two samples' `_question`s differ in both record and prompt."""
    return a[0] != b[0] and a[1] != b[1]


def kl_partners(pool: Sequence[dict], indices: Sequence[int]) -> list[int]:
    """For each sample `pool[i]` of the micro-batch `indices`, the pool index of the sample whose
    answer its KL row takes (module docstring: never one answering the same question).

    TRL's pairing first: the micro-batch rotated by one, (x_1, y_n), (x_2, y_1), ... (KTOTrainer
    rotates `per_device_train_batch_size` rows of its unpaired dataset); when that pairs a sample
    with its own question, the smallest rotation that pairs none (the same answers, other
    prompts); when no rotation does (the two sides of one pair make up the batch), each sample takes
    the answer of the nearest earlier sample (cyclic) that answers another question, of the
    micro-batch if it holds one, else of the pool.

    Raises:
        ValueError: no sample of the pool answers another question than some sample of the batch.
    """
    questions = [_question(pool[i]) for i in indices]
    n = len(indices)
    for shift in range(1, n):
        if all(_other_question(questions[j], questions[j - shift]) for j in range(n)):
            return [indices[j - shift] for j in range(n)]
    out = []
    for j, i in enumerate(indices):
        inside = next((indices[j - k] for k in range(1, n) if _other_question(questions[j], questions[j - k])), None)
        if inside is None:
            inside = next(
                (
                    q % len(pool)
                    for q in range(i - 1, i - len(pool), -1)
                    if _other_question(questions[j], _question(pool[q % len(pool)]))
                ),
                None,
            )
        if inside is None:
            raise ValueError("kto: every sample answers the same question, so the KL estimate has no mismatched answer")
        out.append(inside)
    return out


def kl_partner_problem(samples: Sequence[dict], split: str) -> Optional[str]:
    """Why some sample of `samples` has no KL partner (every other sample answers its question:
    the same record or the same prompt), or None."""
    records = Counter(s["record"] for s in samples)
    prompts = Counter(_question(s)[1] for s in samples)
    both = Counter(_question(s) for s in samples)
    for s in samples:
        key = _question(s)
        if len(samples) - records[key[0]] - prompts[key[1]] + both[key] == 0:
            return (
                f"kto {split} data ({s['source']}): no other "
                "sample answers another question, so the KL estimate has no "
                f"mismatched answer for it; add prompts, or use kto.loss_type apo_zero_unpaired (no KL estimate)"
            )
    return None


def mismatched_rows(pool: Sequence[dict], indices: Sequence[int], seq_length: int) -> list[dict]:
    """KTO's KL rows of the micro-batch `indices` of `pool` (TRL's KL completions): each sample's
    prompt with the answer `kl_partners` picks, cut to `seq_length` from the oldest prompt token
    (at least one kept).

    Raises:
        ValueError: see `kl_partners`.
    """
    rows = []
    for i, partner in zip(indices, kl_partners(pool, indices)):
        sample, other = pool[i], pool[partner]
        prompt, answer = sample["input_ids"][: sample["prompt_len"]], other["input_ids"][other["prompt_len"] :]
        prompt = prompt[max(0, len(prompt) - max(1, seq_length - len(answer))) :]
        ids = (prompt + answer)[:seq_length]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * len(prompt) + ids[len(prompt) :]})
    return rows


def build_kto_data(
    cfg, tokenizer, template: Template, seq_length: int, split: str, stats: Optional[dict] = None
) -> list[dict]:
    """The samples of one split (module docstring), through the token cache; `stats`, when given,
    receives the counts (desirable, undesirable, dropped_overlong, truncated).

    Raises:
        DataError: bad records (or ones the template cannot render) with on_error='strict'.
        ValueError: unknown split.
    """

    def build(check: Check) -> Built:
        records = split_records(cfg, "kto", split, check, system_prompt=cfg.system_prompt)
        return unpaired_samples(records, tokenizer, template, seq_length, cfg.truncation, split, check)

    built = through_cache("kto", cfg, tokenizer, split, build, template=template, seq_length=seq_length)
    if stats is not None:
        stats.update(built.info)
    log.info("kto %s data: %s", split, ", ".join(f"{k}={v}" for k, v in built.info.items()))
    warn_drops(f"kto {split} data", built.info, cut=f"lost their oldest prompt tokens to fit seq_length {seq_length}")
    return built.samples
