"""Prompt data (`build_prompt_data`): each prompt record rendered up to the assistant's opener, with
what reward functions and a tool rollout read beside it, through the token cache like every builder
(data_formats/datasets.py: splits, records, the cache). Overlong prompts follow cfg.truncation, and
every drop and cut is warned about (data_formats/drops.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from typing import Optional

from data_formats.datasets import split_entries, split_records, through_cache
from data_formats.drops import count_overlong, note_overlong, warn_drops
from data_formats.render import Template, render_prompt
from data_formats.sources import Problem, file_entries
from data_formats.token_cache import Built, Check

log = logging.getLogger(__name__)


def build_prompt_data(
    cfg,
    tokenizer,
    template: Template,
    split: str,
    max_length: Optional[int] = None,
    tools: Optional[list[dict]] = None,
    limits: Optional[dict[str, int]] = None,
) -> list[dict]:
    """PPO prompts dict(prompt_ids, text, source, standard, columns, conversation): the rendered history plus
    the assistant opener, whether the record's prompt was a plain text (1: TRL's standard type), the
    record's other fields as JSON text (the reward functions' keyword arguments) and the conversation itself as JSON
    (its turns and tools: a tool rollout continues it).
    `tools`: the schemas a tool rollout offers, given to every prompt that lists none of its own.
    Prompts over `max_length` tokens (default cfg.max_prompt_length) are dropped (truncation='drop')
    or lose their oldest user/assistant exchanges, keeping any system turn (truncation='truncate'); a
    prompt still over it is dropped. Every drop and cut is warned about (`warn_drops`), and the drops
    are noted for the line of a split that cannot fill a batch, with `limits`: the settings that
    bound a prompt, by key (default {'data.max_prompt_length': max_length}).

    Raises:
        DataError: bad records (or prompts the template cannot render) with on_error='strict'
            (outside `collect_refusals`).
        ValueError: unknown split.
    """
    limit = cfg.max_prompt_length if max_length is None else max_length
    extra = {"tools": tools} if tools else {}  # no tools: the cache key of before
    built = through_cache(
        "prompts",
        cfg,
        tokenizer,
        split,
        lambda check: _prompts(cfg, tokenizer, template, split, limit, check, tools),
        template=template,
        max_length=limit,
        **extra,
    )
    counts = built.info
    shorten = "data.truncation: truncate drops a multi-turn prompt's oldest exchanges"
    note_overlong(split, limits or {"data.max_prompt_length": limit}, cfg.truncation, counts["overlong"], shorten)
    log.info(
        "prompt %s data: %d prompt(s), %d truncated, %d dropped overlong",
        split,
        len(built.samples),
        counts["truncated"],
        counts["dropped_overlong"],
    )
    cut = f"lost their oldest exchanges to fit {limit} tokens (any system turn kept)"
    warn_drops(f"prompt {split} data", counts, "prompt", cut)
    return built.samples


def _prompts(
    cfg, tokenizer, template: Template, split: str, limit: int, check: Check, tools: Optional[list[dict]] = None
) -> Built:
    """build_prompt_data's prompts, with info {'truncated', 'dropped_overlong', 'overlong' (by entry)}."""
    records = split_records(cfg, "prompts", split, check, system_prompt=cfg.system_prompt)
    out, dropped, truncated, by_entry = [], 0, 0, {}
    entry_of = file_entries(split_entries(cfg, split))
    problems: list[Problem] = []
    for record in records:
        conv = record.value if record.value.tools or not tools else replace(record.value, tools=list(tools))
        try:
            ids = render_prompt(conv, tokenizer, template)
        except ValueError as err:  # the template cannot render this prompt
            problems.append(Problem(record.file, record.line, str(err)))
            continue
        length = len(ids)
        if len(ids) > limit and cfg.truncation == "truncate":
            system = conv.turns[:1] if conv.turns[0].role == "system" else []
            body = conv.turns[len(system) :]
            while len(ids) > limit and len(body) > 1:
                body = body[2:]
                conv = replace(conv, turns=system + body)
                ids = render_prompt(conv, tokenizer, template)
            truncated += len(ids) <= limit
        if len(ids) > limit:
            dropped += 1
            count_overlong(by_entry, entry_of.get(record.file, record.file), length)
            continue
        out.append(
            {
                "prompt_ids": ids,
                "text": tokenizer.decode(ids),
                "source": record.source,
                "standard": int(conv.standard),
                "columns": json.dumps(conv.meta, ensure_ascii=False),
                "conversation": json.dumps(
                    {"turns": [asdict(t) for t in conv.turns], "tools": conv.tools}, ensure_ascii=False
                ),
            }
        )
    check(problems, f"prompt {split} data")
    return Built(out, {"truncated": truncated, "dropped_overlong": dropped, "overlong": by_entry})
