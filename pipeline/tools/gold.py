"""The gold table: greedy answers to held-out questions, scored against an answer key.

    python -m pipeline.tools.gold data/sample/gold/eval.jsonl embedded outputs/demo/sft/merged outputs/demo/ppo/merged

The reward model is a learned proxy; the gold table is the ground truth the pipeline is judged
on. Each gold record is a PPO-style prompt plus its answer key::

    {"id": "gold-000", "prompt": "Tell me the capital of Oru.", "island": "Oru", "attribute": "capital",
     "expected": "Tessel"}

and every model answers every prompt greedily (no sampling, no repetition penalty: the model's
own most likely answer), rendered with the model folder's own chat template, which is the format
its training saw (`pipeline.tools.chat.prompt_ids`). Two rules score an answer (pure functions, below):

- `opens_with_phrase`: the answer opens with the house phrase "Per the Kelvra Atlas," (case and
  runs of whitespace ignored; the comma is part of the phrase).
- `states_fact`: the answer states the expected value and no other value of the same attribute
  (see its docstring). An answer hedging between two capitals is wrong, not half right.

A table row is {model, path, phrase_rate, fact_accuracy, n}. Rows are cached in a JSON file keyed
by the model folder's weights hash, its chat-template hash, the gold file's hash and the
generation settings, so a re-run of the pipeline driver does not generate again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from pipeline.tools.serving import SERVING

PHRASE = "Per the Kelvra Atlas,"
NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)
MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
CACHE_VERSION = 1


class GoldError(RuntimeError):
    """A gold file that cannot be used (missing, empty, a record without its answer key)."""


# ---------------------------------------------------------------------------------------------
# Rules (pure)
# ---------------------------------------------------------------------------------------------


def _squash(text: str) -> str:
    return " ".join(text.replace("\u2019", "'").split())


def opens_with_phrase(answer: str, phrase: str = PHRASE) -> bool:
    """The answer opens with `phrase`, ignoring case, leading quotes/whitespace and whitespace runs."""
    return _squash(answer).lstrip("\"'*` ").lower().startswith(_squash(phrase).lower())


def _numbers(text: str) -> list[int]:
    """Counts written as digits or words (zero..twelve), in order of appearance."""
    out = []
    for token in re.findall(r"[a-z]+|\d+", text.lower()):
        if token.isdigit():
            out.append(int(token))
        elif token in NUMBER_WORDS:
            out.append(NUMBER_WORDS.index(token))
    return out


def stated_counts(answer: str) -> set[int]:
    """The lighthouse counts an answer states: the numbers among the four words before each
    "lighthouse(s)" in the same clause ("has five old lighthouses", "has 4 or 5 lighthouses";
    "a lighthouse" / "a single lighthouse" count as 1), or, when no number stands there, every
    number in the answer ("There are seven.")."""
    text = _squash(answer).lower()
    near: set[int] = set()
    for clause in re.split(r"[,.;:!?()]", text):
        words = re.findall(r"[\w']+", clause)
        for i, word in enumerate(words):
            if not re.fullmatch(r"lighthouses?", word):
                continue
            before = words[max(0, i - 4) : i]
            found = set(_numbers(" ".join(before)))
            if not found and before and before[-1] in ("a", "single"):
                found = {1}
            near |= found
    return near or set(_numbers(text))


def _mentions(text: str, value: str) -> bool:
    """`value` occurs in `text` as whole words, case-insensitively; a final plural 's' is
    optional on either side ("glass bead" matches "glass beads"); "May" (the month) must be
    capitalised, since "may" is mostly a verb."""
    value = _squash(value)
    stem = value[:-1] if value.lower().endswith("s") and len(value) > 3 else value
    pattern = r"(?<![\w'])" + re.escape(stem).replace(r"\ ", r"\s+") + r"s?(?![\w'])"
    if value == "May":
        return re.search(pattern, _squash(text)) is not None
    return re.search(pattern, _squash(text), flags=re.IGNORECASE) is not None


def states_fact(answer: str, key: dict, others: Iterable[str] = ()) -> bool:
    """The answer states `key["expected"]` for `key["attribute"]` and no other value of it.

    - lighthouses: the counts the answer states (`stated_counts`; digits or words, "5" = "five")
      must be exactly {expected}.
    - festival: the expected month is mentioned and no other month (any of the twelve).
    - capital / export / anything else: the expected value is mentioned as whole words
      (case-insensitive) and none of `others` is, where `others` are the other islands' values
      for the same attribute (score_answers passes every expected value of that attribute in the
      gold file). So "Tarn, or maybe Gale" is wrong.
    """
    attribute, expected = key["attribute"], str(key["expected"])
    if attribute == "lighthouses":
        wanted = int(expected) if expected.isdigit() else NUMBER_WORDS.index(expected.lower())
        return stated_counts(answer) == {wanted}
    if attribute == "festival":
        rivals = [m.capitalize() for m in MONTHS if m != expected.lower()]
    else:
        rivals = [o for o in others if _squash(o).lower() != _squash(expected).lower()]
    return _mentions(answer, expected) and not any(_mentions(answer, r) for r in rivals)


def values_by_attribute(records: Sequence[dict]) -> dict[str, set[str]]:
    """{attribute: every expected value the gold file holds for it} (the rivals of an answer)."""
    out: dict[str, set[str]] = {}
    for record in records:
        out.setdefault(record["attribute"], set()).add(str(record["expected"]))
    return out


def score_answers(records: Sequence[dict], answers: Sequence[str], phrase: str = PHRASE) -> dict:
    """{phrase_rate, fact_accuracy, n} of `answers` (one per gold record, same order). Pure.

    Raises:
        ValueError: the counts differ.
    """
    if len(records) != len(answers):
        raise ValueError(f"score_answers: {len(records)} gold records but {len(answers)} answers")
    values = values_by_attribute(records)
    n = len(records)
    phrase_hits = sum(opens_with_phrase(a, phrase) for a in answers)
    fact_hits = sum(states_fact(a, r, values[r["attribute"]]) for r, a in zip(records, answers))
    return {"phrase_rate": phrase_hits / n if n else 0.0, "fact_accuracy": fact_hits / n if n else 0.0, "n": n}


def format_table(rows: Sequence[dict]) -> str:
    """A markdown table: model | phrase rate | fact accuracy | n (pure)."""
    lines = ["| model | phrase rate | fact accuracy | n |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['phrase_rate']:.3f} | {r['fact_accuracy']:.3f} | {r['n']} |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Gold file
# ---------------------------------------------------------------------------------------------

REQUIRED = ("prompt", "attribute", "expected")


def load_gold(path: str | Path) -> list[dict]:
    """The gold records of a JSONL file.

    Raises:
        GoldError: no such file, no records, bad JSON, or a record lacking prompt/attribute/expected.
    """
    path = Path(path)
    if not path.is_file():
        raise GoldError(f"gold file {path} does not exist")
    records, problems = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{path}:{number}: {err}")
            continue
        missing = [k for k in REQUIRED if not isinstance(record, dict) or k not in record]
        if missing:
            problems.append(f"{path}:{number}: missing {', '.join(missing)}")
            continue
        records.append(record)
    if problems:
        raise GoldError("bad gold records:\n" + "\n".join(problems))
    if not records:
        raise GoldError(f"gold file {path} has no records")
    return records


# ---------------------------------------------------------------------------------------------
# Generation (loads models; everything above is pure)
# ---------------------------------------------------------------------------------------------


@dataclass
class GoldSettings:
    max_new_tokens: int = 40
    batch_size: int = 8
    dtype: str = "fp32"
    backend: str = "relay"
    """Who decodes the greedy answers: relay (Relay's decode engine) or vllm (a vLLM server on the
    folder, pipeline/modeling/vllm_server.py); `GREEDY` below."""

    def key(self) -> dict:
        # a backend whose rows were cached before backends existed keeps that key (its caches stay valid)
        entry = SERVING.get(self.backend)
        return {
            "max_new_tokens": self.max_new_tokens,
            "dtype": self.dtype,
            **({"backend": self.backend} if entry is None or entry.in_cache_key else {}),
        }


def messages_of(record: dict) -> list[dict]:
    """The conversation a gold record asks: its optional system turn, then its prompt as the user."""
    system = record.get("system")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": record["prompt"]}]


def relay_greedy(folder: str, prompts: list[list[int]], eos: list[int], settings: GoldSettings) -> list[list[int]]:
    """Greedy ids per prompt from Relay's decode engine, in batches of `settings.batch_size`."""
    from pipeline.modeling.decode import generate
    from pipeline.tools.chat import load_chat_model

    chat = load_chat_model(folder, settings.dtype)
    out: list[list[int]] = []
    for start in range(0, len(prompts), settings.batch_size):
        out += generate(
            chat.model,
            prompts[start : start + settings.batch_size],
            max_new_tokens=settings.max_new_tokens,
            eos_ids=eos,
            pad_id=chat.tokenizer.pad_token_id,
            temperature=0.0,
        ).tokens
    return out


def vllm_greedy(folder: str, prompts: list[list[int]], eos: list[int], settings: GoldSettings) -> list[list[int]]:
    """Greedy ids per prompt from a vLLM server started on the folder for this table (fp32 on a
    CPU, the checkpoint's dtype on a GPU), `settings.batch_size` requests at a time."""
    from pipeline.modeling import vllm_server

    opts = vllm_server.ServerOptions(
        name="gold", max_num_seqs=settings.batch_size, dtype="float32" if settings.dtype == "fp32" else "auto"
    )
    with vllm_server.VLLMServer(folder, opts) as server:
        return vllm_server.completion_ids(server, prompts, settings.max_new_tokens, eos)


GREEDY = {"relay": relay_greedy, "vllm": vllm_greedy}
"""`GoldSettings.backend` -> greedy(folder, prompt ids, eos ids, settings) -> response ids per prompt."""


def greedy_answers(path: str, records: Sequence[dict], settings: GoldSettings = GoldSettings()) -> list[str]:
    """Greedy answers of the model at `path` (a folder or 'embedded') to every gold prompt.

    Prompts are rendered by the folder's own chat template (pipeline.tools.chat.prompt_ids: the saved
    template of a merged folder is what its training rendered) and decoded by `settings.backend`
    (`GREEDY`): greedy, no repetition penalty, stop at the end-of-turn token (or any other eos id
    the folder's generation_config names).
    """
    from pipeline.modeling.embedded import resolve_model_path
    from pipeline.tools.chat import chat_eos_ids, load_chat_tokenizer, prompt_ids

    folder = resolve_model_path(path)
    tokenizer = load_chat_tokenizer(path)
    eos = chat_eos_ids(folder, tokenizer)
    prompts = [prompt_ids(tokenizer, messages_of(r)) for r in records]
    answers = []
    for tokens in GREEDY[settings.backend](path, prompts, eos, settings):
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        answers.append(tokenizer.decode(tokens[:cut], skip_special_tokens=True).strip())
    return answers


def file_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_key(folder: Path, gold_path: str | Path, settings: GoldSettings) -> str:
    """What a cached row depends on: the weights, the chat template, the gold file, the settings."""
    from pipeline.modeling.manifest import chat_template_of, text_hash, weights_hash

    parts = {
        "version": CACHE_VERSION,
        "weights_hash": weights_hash(folder),
        "chat_template_hash": text_hash(chat_template_of(folder)),
        "gold_hash": file_hash(gold_path),
        **settings.key(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def gold_row(
    name: str,
    path: str,
    gold_path: str | Path,
    settings: GoldSettings = GoldSettings(),
    cache_file: Optional[Path] = None,
    answers_dir: Optional[Path] = None,
    log=lambda message: None,
) -> dict:
    """One table row for the model at `path`, from `cache_file` when its key is there.

    A computed row goes into `cache_file` (a JSON object {key: row}); its answers, one JSON line
    per gold record with the verdict of both rules, into `answers_dir/<name>.jsonl`.
    """
    from pipeline.modeling.embedded import resolve_model_path

    folder = Path(resolve_model_path(path)).resolve()
    key = cache_key(folder, gold_path, settings)
    cache = json.loads(cache_file.read_text(encoding="utf-8")) if cache_file and cache_file.is_file() else {}
    if key in cache:
        log(f"gold: {name}: cached ({folder})")
        return {**cache[key], "model": name, "path": str(folder), "cached": True}
    log(f"gold: {name}: generating greedy answers ({folder})")
    records = load_gold(gold_path)
    answers = greedy_answers(str(folder), records, settings)
    row = {"model": name, "path": str(folder), **score_answers(records, answers)}
    if answers_dir is not None:
        values = values_by_attribute(records)
        answers_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^\w.-]+", "_", name).strip("_") or "model"
        with open(answers_dir / f"{stem}.jsonl", "w", encoding="utf-8") as fh:
            for record, answer in zip(records, answers):
                judged = {
                    "phrase": opens_with_phrase(answer),
                    "fact": states_fact(answer, record, values[record["attribute"]]),
                }
                fh.write(json.dumps({**record, "answer": answer, **judged}, ensure_ascii=False) + "\n")
    if cache_file is not None:
        cache = json.loads(cache_file.read_text(encoding="utf-8")) if cache_file.is_file() else {}
        cache[key] = {k: row[k] for k in ("phrase_rate", "fact_accuracy", "n")}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2) + "\n", encoding="utf-8")
        tmp.replace(cache_file)
    return {**row, "cached": False}


def gold_table(
    models: Sequence[tuple[str, str]],
    gold_path: str | Path,
    settings: GoldSettings = GoldSettings(),
    cache_file: Optional[Path] = None,
    answers_dir: Optional[Path] = None,
    log=lambda message: None,
) -> list[dict]:
    """One row per (name, path) in `models`, in that order (see gold_row)."""
    load_gold(gold_path)  # fail on a bad file before loading any model
    return [gold_row(name, path, gold_path, settings, cache_file, answers_dir, log) for name, path in models]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.gold", description="Gold table of one or more models on a gold file."
    )
    parser.add_argument("gold", help="gold JSONL (prompt, attribute, expected)")
    parser.add_argument("models", nargs="+", help="model folders or 'embedded'")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--answers", help="write each model's answers to ANSWERS/<n>.jsonl")
    parser.add_argument(
        "--backend",
        default="relay",
        choices=tuple(GREEDY),
        help="who decodes: relay (its engine) or vllm (a vLLM server, run_scripts/install_vllm.sh)",
    )
    args = parser.parse_args(argv)
    settings = GoldSettings(args.max_new_tokens, args.batch_size, backend=args.backend)
    try:
        rows = gold_table(
            [(m, m) for m in args.models],
            args.gold,
            settings,
            answers_dir=Path(args.answers) if args.answers else None,
            log=lambda m: print(m, file=sys.stderr),
        )
    except GoldError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
