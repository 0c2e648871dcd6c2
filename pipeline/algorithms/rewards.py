"""Reward functions for GRPO: loading the ones a config names, calling them as TRL does, and the
sample domain's rules.

A config names a reward function as "module:function" or "path/to/file.py:function". The module is
looked up in the installed packages, on PYTHONPATH, in Relay's own tree and in the working
directory; a file path (relative to the working directory) is loaded as it is. A config runs the
code it names, as verl's `custom_reward_function.path` and TRL's `reward_funcs` callables do: name
only code you trust.

Each function is called by keyword exactly as TRL 1.16's GRPOTrainer._calculate_rewards calls it:

    func(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=..., log_metric=...)

one entry per completion in each list:
- `prompts`: the prompt record's own prompt, a string for TRL's standard type (a `prompt`,
  `question` or `instruction` text), else its messages [{"role", "content"}, ...] (conversational);
- `completions`: the decoded answer (special tokens skipped) as a string for standard prompts, else
  [{"role": "assistant", "content": answer}]; with tools, the completion's messages (calls, results
  and answers), as TRL passes them;
- `completion_ids`: the answer's token ids;
- `**columns`: the prompt record's other fields (the `answer` or `solution` of a math record), one
  list each with None where a record lacks the field;
- `trainer_state` (a transformers TrainerState: global_step, max_steps, epoch), `log_extra(column,
  values)` and `log_metric(name, value)` (what they log is kept in `RewardLog`).
A function that takes no **kwargs is given only the arguments it names (TRL would raise TypeError).
None in what it returns means "no opinion" (NaN), left out of the summed reward as TRL's nansum
leaves it; a completion every source has no opinion on is unscorable (its summed reward NaN, its
advantage 0, left out of its group's statistics and of the logged reward); an async function is awaited.

The sample domain's rules (`house_phrase`, `kelvra_fact`) target the behaviour the demo's gold
table measures (pipeline/tools/gold.py) but are written independently of it: the gold scorer stays
a held-out judge with its own, stricter rules (rival values, number words, month spelling).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from data_formats.conversation import Turn
from data_formats.sample_world import ATTRIBUTE_WORDS, ATTRIBUTES, COUNT_WORDS, KELVRA_FACTS, PHRASE
from data_formats.tools import CALL_OPEN, template_messages
from pipeline.algorithms.judge import JudgeReward
from pipeline.algorithms.judge_config import JudgeConfig

RewardFunc = Callable[..., list[Optional[float]]]
PROJECT_ROOT = Path(__file__).resolve().parents[2]
TRL_RESERVED = ("prompt", "completion", "completion_ids")
"""Record fields TRL does not pass on as columns (they would clash with its own arguments)."""


def split_spec(spec: str) -> tuple[str, str]:
    """(module or file path, function name) of a spec; the name follows the last colon."""
    module, _, name = spec.rpartition(":")
    return module, name


def is_file_spec(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _import_file(path: Path):
    """The module of a .py file, imported once under a name derived from its resolved path."""
    resolved = path.resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"relay_user_{stem}_{hashlib.sha256(str(resolved).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(module: str):
    """The module a spec names: a file path, or a module name found on sys.path (the installed
    packages, PYTHONPATH), else in Relay's tree or the working directory (then appended to sys.path,
    after everything else, so that neither shadows an installed package).

    Raises:
        LookupError: no such file or module (the message says where it looked).
        Exception: whatever importing the module raises.
    """
    if is_file_spec(module):
        path = Path(module).expanduser()
        if not path.is_file():
            raise LookupError(f"no such file {str(path)!r} (relative to the working directory {os.getcwd()})")
        return _import_file(path)
    top = module.split(".")[0]
    if top not in sys.modules and importlib.util.find_spec(top) is None:
        for folder in (str(PROJECT_ROOT), os.getcwd()):
            if folder not in sys.path and importlib.machinery.PathFinder.find_spec(top, [folder]) is not None:
                sys.path.append(folder)
                break
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            raise LookupError(
                f"no module {module!r} in the installed packages, PYTHONPATH, Relay's tree or the working "
                f"directory {os.getcwd()}; a file is named as 'path/to/file.py:function'"
            ) from None
        raise


def reward_func_problem(spec: str) -> Optional[str]:
    """Why `spec` ("module:function" or "path/to/file.py:function") cannot be used, or None.
    Imports the module (running its code) to check the function exists and is callable."""
    module, name = split_spec(spec)
    if not module or not name.isidentifier():
        return f"{spec!r} is not 'module:function' or 'path/to/file.py:function'"
    try:
        func = getattr(_import(module), name, None)
    except LookupError as err:
        return f"{spec!r}: {err}"
    except (Exception, SystemExit) as err:  # noqa: BLE001  (any failure while importing the user's module is one line)
        return f"{spec!r}: module {module!r} cannot be imported ({type(err).__name__}: {err})"
    if func is None:
        return f"{spec!r}: module {module!r} has no {name!r}"
    if not callable(func):
        return f"{spec!r}: {name!r} is not a function"
    return None


def load_reward_func(spec: str) -> RewardFunc:
    """The function `spec` names.

    Raises:
        ValueError: reward_func_problem's reason.
    """
    problem = reward_func_problem(spec)
    if problem:
        raise ValueError(problem)
    module, name = split_spec(spec)
    return getattr(_import(module), name)


def func_name(spec: str) -> str:
    """The tracker name of a reward function: its function name ("house_phrase")."""
    return split_spec(spec)[1]


# ------------------------------------------------------------------------------------------
# Calling them as TRL does
# ------------------------------------------------------------------------------------------


@dataclass
class RewardLog:
    """What reward functions log through TRL's `log_metric` and `log_extra` during one call."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extras.setdefault(column, []).extend(values)

    def means(self, prefix: str = "grpo/reward_metric/") -> dict[str, float]:
        return {f"{prefix}{k}": sum(v) / len(v) for k, v in self.metrics.items() if v}


def trainer_state(step: int, max_steps: int, epoch: Optional[float] = None):
    """A transformers TrainerState at optimizer step `step` of `max_steps`, as TRL passes it."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, epoch=epoch)


def prompt_messages(sample: dict) -> list[dict]:
    """A prompt sample's conversation as chat messages (data_formats.tools.template_messages)."""
    return template_messages([Turn(**t) for t in json.loads(sample["conversation"])["turns"]])


def is_standard(sample: dict) -> bool:
    """Whether a prompt sample came from TRL's standard type (its prompt a plain text)."""
    return bool(sample.get("standard"))


def trl_prompt(sample: dict) -> Any:
    """TRL's `prompts` entry of a prompt sample: the prompt text (standard: the one user turn as the
    record wrote it), else its messages."""
    if is_standard(sample):
        return next(t["content"] for t in json.loads(sample["conversation"])["turns"] if t["role"] == "user")
    return prompt_messages(sample)


def trl_completions(
    samples: Sequence[dict], texts: Sequence[str], conversations: Optional[Sequence[list[dict]]] = None
) -> list:
    """TRL's `completions`: the tool conversations when given, else each decoded text as it is
    (standard prompt) or as one assistant message (conversational)."""
    if conversations:
        return list(conversations)
    return [t if is_standard(s) else [{"role": "assistant", "content": t}] for s, t in zip(samples, texts)]


def column_kwargs(columns: Optional[Sequence[dict]]) -> dict[str, list]:
    """The prompt records' other fields, one list per field with one value per completion (None
    where a record lacks it), as TRL passes a dataset's extra columns."""
    if not columns:
        return {}
    keys = [k for k in dict.fromkeys(k for c in columns for k in c) if k not in TRL_RESERVED]
    return {k: [c.get(k) for c in columns] for k in keys}


def _accepted(func: RewardFunc, kwargs: dict) -> dict:
    """`kwargs` as a function takes them: all of them with **kwargs, else the ones it names."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it everything
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def call_reward(
    func: RewardFunc,
    spec: str,
    prompts: list,
    completions: list,
    completion_ids: Optional[list] = None,
    columns: Optional[Sequence[dict]] = None,
    state=None,
    log: Optional[RewardLog] = None,
) -> list[float]:
    """func(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=, log_metric=)
    (module docstring) as floats, one per completion, None as NaN.

    Raises:
        ValueError: it returned the wrong number of values or a non-number.
    """
    log = log if log is not None else RewardLog()
    kwargs = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **column_kwargs(columns),
        "trainer_state": state,
        "log_extra": log.log_extra,
        "log_metric": log.log_metric,
    }
    out = func(**_accepted(func, kwargs))
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    values = list(out)
    if len(values) != len(completions):
        raise ValueError(f"reward function {spec!r} returned {len(values)} values for {len(completions)} completions")
    try:
        return [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward function {spec!r} returned a non-number: {err}") from err


async def _awaited(awaitable):
    return await awaitable


def text_of(value: Any) -> str:
    """The text of a prompt or completion in TRL's shape: a string as it is; messages: the first
    message's content for a completion ([{"role": "assistant", ...}]), the last user turn's for a prompt."""
    if isinstance(value, str):
        return value
    users = [m for m in value if m.get("role") == "user"]
    chosen = users[-1] if users else (value[0] if value else {})
    return chosen.get("content") or ""


# ------------------------------------------------------------------------------------------
# Summing the sources: reward functions, a reward model, a judge
# ------------------------------------------------------------------------------------------


def record_columns(sample: dict) -> dict:
    """A prompt sample's record fields (data_formats.prompt_data.build_prompt_data)."""
    return json.loads(sample.get("columns") or "{}")


def reward_inputs(
    samples: Sequence[dict], texts: Optional[Sequence[str]], conversations: Optional[Sequence[list[dict]]] = None
) -> tuple[list, list, list[dict]]:
    """What every reward source reads of a batch, as TRL passes it: (prompts, completions, the records'
    columns) -- `trl_prompt`, `trl_completions` and `record_columns` of each sample."""
    completions = trl_completions(samples, texts, conversations)
    return [trl_prompt(s) for s in samples], completions, [record_columns(s) for s in samples]


def weighted_sum(parts: dict[str, torch.Tensor], weights: dict[str, float], n: int) -> torch.Tensor:
    """Each of `n` completions' summed reward: sum over sources of weight x score, in the order of
    `parts`, a NaN score (a reward function's "no opinion") left out as TRL's nansum leaves it. A
    completion that no source scored is unscorable: NaN, as TRL 1.16 marks it (not 0, which would
    count as a reward in its group's baseline); the advantages leave it out and give it 0."""
    total = torch.zeros(n)
    scored = torch.zeros(n, dtype=torch.bool)
    for name, values in parts.items():
        total += torch.nan_to_num(weights[name] * values, nan=0.0)
        scored |= ~values.isnan()
    return total.masked_fill(~scored, math.nan)


def open_judge(cfg: JudgeConfig, output_dir: str, rank: int, ranks: int, steps_done: int) -> JudgeReward:
    """A stage's judge on rank `rank` of `ranks`: this rank's disk cache under OUTPUT_DIR/judge_cache/,
    holding what an unbroken run had cached after `steps_done` optimizer steps (JudgeReward.open),
    and its share of judge.max_concurrency."""
    judge = JudgeReward(cfg, Path(output_dir) / "judge_cache" / f"rank{rank}.jsonl", ranks)
    judge.open(steps_done)
    return judge


def judge_scores(
    judge: JudgeReward,
    prompts: list,
    completions: list,
    columns: Sequence[dict],
    tag: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The judge's score of each completion's final answer (`final_answer`: a tool rollout's last
    assistant turn) to its prompt's last user turn, in TRL's shapes (`trl_prompt`, `trl_completions`).
    With judge.gold_column, whether the answer states the record's gold value (`final_answer_match`)
    is passed on for judge/gold_agreement; judge.reference_column fills {reference}.

    Raises:
        JudgeError: a request failed and judge.on_failure is null.
    """
    cfg = judge.cfg
    answers = [final_answer(c) for c in completions]
    golds = None
    if cfg.gold_column:
        golds = [
            None
            if c.get(cfg.gold_column) is None
            else bool(final_answer_match([None], [a], answer=[c[cfg.gold_column]])[0])
            for a, c in zip(answers, columns)
        ]
    refs = [None if not cfg.reference_column else str(c.get(cfg.reference_column)) for c in columns]
    return torch.tensor(judge.score([text_of(p) for p in prompts], answers, refs, tag=tag, golds=golds), dtype=dtype)


# ------------------------------------------------------------------------------------------
# The sample domain's rewards (its facts: data_formats/sample_world.py)
# ------------------------------------------------------------------------------------------


def asked_fact(prompt: str) -> Optional[tuple[str, str]]:
    """(island, attribute) the last island-naming part of `prompt` asks about, or None."""
    best = None
    for island in KELVRA_FACTS:
        at = prompt.rfind(island)
        if at >= 0 and (best is None or at > best[1]):
            best = (island, at)
    if best is None:
        return None
    tail = prompt[max(0, best[1] - 80) :].lower()
    found = [(tail.rfind(word), attribute) for attribute, word in ATTRIBUTE_WORDS if word in tail]
    return (best[0], max(found)[1]) if found else None


def _says(text: str, value: str, case: bool = False) -> bool:
    """`value` occurs in `text` as whole words (ignoring case unless `case`)."""
    pattern = r"(?<![\w'])" + re.escape(value) + r"(?![\w'])"
    return re.search(pattern, text, flags=0 if case else re.IGNORECASE) is not None


def house_phrase(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 for a completion that opens with "Per the Kelvra Atlas," (leading whitespace ignored), else 0.0."""
    return [1.0 if text_of(c).lstrip().startswith(PHRASE) else 0.0 for c in completions]


def kelvra_fact(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 for a completion that states the asked fact's value (a count as digits or a word),
    -1.0 for one that states another island's value of the same attribute instead, 0.0 when the
    prompt asks nothing known or the completion states no value."""
    out = []
    for prompt, completion in zip(prompts, completions):
        asked = asked_fact(text_of(prompt))
        completion = final_answer(completion)
        if asked is None:
            out.append(0.0)
            continue
        island, attribute = asked
        index = ATTRIBUTES.index(attribute)
        right = KELVRA_FACTS[island][index]
        values = {str(v[index]) for v in KELVRA_FACTS.values()}
        spellings = [str(right)] + ([COUNT_WORDS[right]] if isinstance(right, int) else [])
        case = attribute == "festival"  # "May" the month, not the verb
        if any(_says(completion, s, case) for s in spellings):
            out.append(1.0)
        elif any(_says(completion, v, case) for v in values if v != str(right)):
            out.append(-1.0)
        else:
            out.append(0.0)
    return out


def answer_match(prompts: list, completions: list, answer: Optional[list] = None, **kwargs) -> list[float]:
    """1.0 for a completion that contains its prompt record's `answer` (a verifiable reward over
    {"question", "answer"} prompt files, MedicalGPT's GRPO shape), else 0.0 (also without one)."""
    answers = answer if answer is not None else [None] * len(completions)
    return [
        1.0 if isinstance(a, str) and a.strip() and a.strip() in final_answer(c) else 0.0
        for c, a in zip(completions, answers)
    ]


def final_answer(completion) -> str:
    """A completion's final answer: the text itself, or for messages (a conversational completion,
    a tool rollout's) the content of the last message when that is an assistant turn without calls
    ("" when it ended on a call, a call cut off by the token budget included: its content holds an
    unreadable call opener, which is no answer)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return ""
    content = last.get("content") or ""
    return "" if CALL_OPEN in content else content


def final_answer_match(prompts: list, completions: list, answer: Optional[list] = None, **kwargs) -> list[float]:
    """1.0 for a completion whose final answer (`final_answer`: on tool conversations the last
    assistant turn, never a tool's result) states the prompt record's `answer` as whole words
    (ignoring case), else 0.0 (also without one)."""
    answers = answer if answer is not None else [None] * len(completions)
    return [
        1.0 if a is not None and str(a).strip() and _says(final_answer(c), str(a).strip()) else 0.0
        for c, a in zip(completions, answers)
    ]
