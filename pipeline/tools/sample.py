"""`relay sample`: prompts -> N sampled answers each from a model folder -> scores (reward functions,
a reward model, an LLM judge: the rewards GRPO sums) -> an SFT file (best-of-N above a threshold,
rejection sampling) or a DPO file (best vs worst with a margin), with the scores kept as extra fields.

    relay sample --model outputs/sft/merged --data.train [data/sample/ppo/train.jsonl] --out samples.jsonl \\
        --mode dpo --num_samples 4 --reward_model outputs/rm/merged --margin 0.5 --seed 0
    relay sample --config sample.yaml [--key value ...]

The prompts are read and rendered as PPO's and GRPO's (`data:` is their prompt section); the answers
come from the RL samplers (pipeline/rl/rollout.py, `backend` relay or hf) under `seed`, so the
same seed gives the same file (with a deterministic judge: temperature 0, or its cache). The file is
what `relay validate --kind sft|dpo` and the SFT and DPO stages read: SFT records are {"messages"}
conversations; DPO records {"prompt", "chosen", "rejected"}, texts for a text prompt sampled alone,
else messages (a system turn, from the record or data.system_prompt, makes the prompt messages),
so the stage reading a record renders the prompt the answers were sampled under; a prompt's tool
schemas go along as `tools`. Answers cut at max_new_tokens (no end-of-turn token) are left out unless
`keep_unfinished`, and empty answers (nothing but whitespace: the model ended at once) always are:
neither is a training target. `scores` holds all N scores in sample order, null for an answer left out.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from data_formats.prompt_data import build_prompt_data
from data_formats.render import make_template
from data_formats.sources import DataError
from data_formats.validate import data_problems
from pipeline.algorithms import rewards as rw
from pipeline.algorithms.judge import JudgeError, JudgeReward
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.config import ConfigError, ModelConfig, PromptDataConfig, load_config
from pipeline.modeling.models import load_model, load_tokenizer
from pipeline.modeling.preflight import model_problems
from pipeline.rl.generators import make_generator
from pipeline.rl.rollout import ActorCritic, assemble, chunks

MODES = ("sft", "dpo")
BACKENDS = ("relay", "hf")
log = logging.getLogger("relay.sample")


@dataclass
class SampleConfig:
    model: str = ""
    """The model folder that answers (a merged model, or 'embedded')."""
    data: PromptDataConfig = field(default_factory=lambda: PromptDataConfig(train=[], eval=[]))
    """The prompts: data.train lists the files, rendered as PPO's prompts (template, system_prompt,
    max_prompt_length)."""
    out: str = ""
    """The JSONL file written (its folder is created; judge_cache/ goes beside it)."""
    mode: str = "dpo"
    """sft: each prompt's best answer when it scores >= threshold; dpo: its best (chosen) and worst
    (rejected) answers when chosen >= rejected + margin and they differ."""
    num_samples: int = 4
    """Answers sampled per prompt (N >= 2 for dpo)."""
    threshold: Optional[float] = None
    """sft: the least score kept (null: every prompt's best answer)."""
    margin: float = 0.0
    """dpo: the least score gap between chosen and rejected (a tie is never a pair)."""
    seed: int = 0
    """Seeds the sampling: the same seed, model and prompts give the same file."""
    max_new_tokens: int = 128
    """Longest answer sampled."""
    temperature: float = 1.0
    """Sampling temperature."""
    backend: str = "relay"
    """The sampler: relay (Relay's decode engine) or hf (transformers' generate)."""
    batch_size: int = 8
    """Prompts sampled together (each with its num_samples answers)."""
    seq_length: int = 1024
    """Longest prompt + answer in tokens (longer prompts are handled by data.truncation)."""
    keep_unfinished: bool = False
    """Consider answers cut at max_new_tokens without an end-of-turn token (empty answers never are)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions "module:function" or "path/file.py:function", called as GRPO calls them."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (null: 1 each)."""
    reward_model: Optional[str] = None
    """A reward model folder (the RM stage's merged/) scoring each whole answer; null: none."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in the summed score."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge (GRPO's judge: section, pipeline/algorithms/judge.py); base_url null: none."""

    def problems(self) -> list[str]:

        out: list[str] = []
        if not self.model:
            out.append("model: required (the model folder that answers)")
        if not self.out:
            out.append("out: required (the JSONL file to write)")
        if not self.data.train:
            out.append("data.train: no prompt files")
        if self.mode not in MODES:
            out.append(f"mode: {self.mode!r} is not one of {MODES}")
        if self.num_samples < (2 if self.mode == "dpo" else 1):
            out.append(
                f"num_samples: {self.mode} needs at least {2 if self.mode == 'dpo' else 1}, got {self.num_samples}"
            )
        if self.backend not in BACKENDS:
            out.append(
                f"backend: {self.backend!r} is not one of {BACKENDS} (vllm follows a training policy's adapter; "
                f"serve the folder with `relay serve --backend vllm` for a fixed model)"
            )
        if self.margin < 0:
            out.append(f"margin: must be >= 0, got {self.margin}")
        if self.max_new_tokens < 1 or self.seq_length <= self.max_new_tokens:
            out.append(
                "max_new_tokens/seq_length: need 1 <= max_new_tokens < seq_length, got "
                f"{self.max_new_tokens}/{self.seq_length}"
            )
        if self.temperature <= 0 or self.batch_size < 1:
            out.append("temperature/batch_size: must be > 0 and >= 1")
        if not self.reward_funcs and not self.reward_model and not self.judge.enabled:
            out.append("reward_funcs / reward_model / judge.base_url: nothing scores the answers")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            out.append(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward functions"
            )
        out += [f"reward_funcs: {p}" for p in filter(None, map(rw.reward_func_problem, self.reward_funcs))]
        return out + self.data.problems() + self.judge.problems()

    def file_problems(self) -> list[str]:
        """The model folders and prompt files, looked at without loading anything."""

        out = model_problems(self.model, "model", need="causal") + data_problems(self.data.train, "data.train")
        if self.reward_model:
            out += model_problems(self.reward_model, "reward_model", need="reward")
        return out


# ------------------------------------------------------------------------------------------
# Choosing what to keep (pure)
# ------------------------------------------------------------------------------------------


def usable(text: str, finished: bool, keep_unfinished: bool) -> bool:
    """Whether an answer can be a training target: not empty (the SFT and DPO readers refuse an answer
    of nothing but whitespace) and finished within max_new_tokens, unless `keep_unfinished`."""
    return bool(text.strip()) and (finished or keep_unfinished)


def considered(answers: Sequence[str], scores: Sequence[Optional[float]]) -> list[int]:
    """The indices of the answers that may be chosen: scored (a None score is an answer left out) and
    not empty."""
    return [i for i, (text, score) in enumerate(zip(answers, scores)) if score is not None and text.strip()]


def best_of_n(answers: Sequence[str], scores: Sequence[Optional[float]], threshold: Optional[float]) -> Optional[int]:
    """The index of the best answer considered (the first of equals), or None when none is or it
    scores below `threshold`."""
    keep = considered(answers, scores)
    if not keep:
        return None
    best = max(keep, key=lambda i: (scores[i], -i))
    return best if threshold is None or scores[best] >= threshold else None


def best_and_worst(
    answers: Sequence[str], scores: Sequence[Optional[float]], margin: float
) -> Optional[tuple[int, int]]:
    """(chosen, rejected): the best and the worst answer considered (the first of equals), or None
    when fewer than two are, the gap is under `margin`, a tie, or the two texts are the same."""
    keep = considered(answers, scores)
    if len(keep) < 2:
        return None
    best = max(keep, key=lambda i: (scores[i], -i))
    worst = min(keep, key=lambda i: (scores[i], i))
    if scores[best] <= scores[worst] or scores[best] < scores[worst] + margin or answers[best] == answers[worst]:
        return None
    return best, worst


def dpo_prompt(sample: dict, messages: list[dict]):
    """A DPO record's prompt: the text of a text prompt sampled alone (its one user turn), else
    the messages it was sampled under (a system turn added by data.system_prompt included), so the
    DPO stage renders the prompt the answers were sampled under."""
    if rw.is_standard(sample) and [m["role"] for m in messages] == ["user"]:
        return rw.trl_prompt(sample)
    return list(messages)


def make_record(
    prompt,
    messages: list[dict],
    answers: Sequence[str],
    scores: Sequence[Optional[float]],
    mode: str,
    pick,
    tools: Optional[list[dict]] = None,
) -> dict:
    """The SFT or DPO record of one prompt, every sampled answer's score beside it in sample order
    (None for an answer left out). SFT: the prompt's `messages` and the answer (one layout for the
    whole file: a validator reads a file's layout from its first record); DPO: TRL's preference type,
    texts for a text `prompt` (`dpo_prompt`), else messages. `tools`: the prompt's tool schemas."""

    def turn(text):
        return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]

    extra = {"scores": [None if s is None else round(float(s), 6) for s in scores]}
    if tools:
        extra["tools"] = list(tools)
    if mode == "sft":
        return {
            "messages": list(messages) + [{"role": "assistant", "content": answers[pick]}],
            "score": extra["scores"][pick],
            **extra,
        }
    chosen, rejected = pick
    return {
        "prompt": prompt,
        "chosen": turn(answers[chosen]),
        "rejected": turn(answers[rejected]),
        "chosen_score": extra["scores"][chosen],
        "rejected_score": extra["scores"][rejected],
        **extra,
    }


# ------------------------------------------------------------------------------------------
# Sampling and scoring
# ------------------------------------------------------------------------------------------


class Scorer:
    """The summed score of answers: reward functions, a reward model and a judge, weighted."""

    def __init__(self, cfg: SampleConfig, tokenizer, device):

        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.funcs = [rw.load_reward_func(spec) for spec in cfg.reward_funcs]
        self.rm = None
        if cfg.reward_model:
            self.rm = (
                load_model(
                    ModelConfig(path=cfg.reward_model, finetuning="full"), None, kind="reward", tokenizer=tokenizer
                )
                .to(device)
                .eval()
            )
        self.judge = None
        if cfg.judge.enabled:
            self.judge = JudgeReward(cfg.judge, Path(cfg.out).parent / "judge_cache" / f"{Path(cfg.out).stem}.jsonl")
            # Every earlier reply to the same request is reused (no training state to stay equal
            # to): a rerun with another threshold or margin asks the judge nothing new.
            self.judge.open(steps_done=1)

    def __call__(self, samples: list[dict], rollout, texts: list[str]) -> list[float]:
        import torch

        cfg = self.cfg
        prompts, completions, columns = rw.reward_inputs(samples, texts)
        total = torch.zeros(len(texts), dtype=torch.float64)
        for spec, func, weight in zip(cfg.reward_funcs, self.funcs, cfg.reward_weights or [1.0] * len(self.funcs)):
            values = rw.call_reward(func, spec, prompts, completions, [list(r) for r in rollout.responses], columns)
            total += torch.nan_to_num(weight * torch.tensor(values, dtype=torch.float64), nan=0.0)
        if self.rm is not None:
            scorer = ActorCritic(self.rm, None, None, self.rm)
            for rows in chunks(len(texts), cfg.batch_size):
                total[rows] += (
                    cfg.reward_model_weight
                    * scorer.reward_scores(
                        rollout.input_ids[rows].to(self.device),
                        rollout.attention_mask[rows].to(self.device),
                        rollout.prompt_width,
                    )
                    .double()
                    .cpu()
                )
        if self.judge is not None:
            scores = rw.judge_scores(self.judge, prompts, completions, columns, tag=0, dtype=torch.float64)
            total += cfg.judge.weight * scores
        return total.tolist()


def run(cfg: SampleConfig) -> dict:
    """Sample, score and write `cfg.out`; returns the counts (prompts, records, skipped, and of
    those `too_few`: too few usable answers, `usable`; with a judge its figures).

    Raises:
        DataError: bad prompt records; OSError: an unreadable model folder; JudgeError: a failed judge
        request with judge.on_failure null.
    """
    import numpy as np
    import torch

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg.model)
    template = make_template(cfg.data, tok)
    samples = build_prompt_data(
        cfg.data, tok, template, "train", min(cfg.data.max_prompt_length, cfg.seq_length - cfg.max_new_tokens)
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy = (
        load_model(ModelConfig(path=cfg.model, finetuning="full"), None, kind="causal", tokenizer=tok).to(device).eval()
    )
    eos = [tok.eos_token_id]
    generator = make_generator(cfg.backend, policy, tok.pad_token_id, eos, cfg.max_new_tokens, cfg.temperature)
    scorer = Scorer(cfg, tok, device)
    n, counts, records = cfg.num_samples, {"prompts": len(samples), "records": 0, "skipped": 0, "too_few": 0}, []
    for start in range(0, len(samples), cfg.batch_size):
        batch = samples[start : start + cfg.batch_size]
        rows = [s for s in batch for _ in range(n)]
        ids = [s["prompt_ids"] for s in rows]
        with torch.no_grad():
            rollout = assemble(ids, generator.generate(ids), tok.pad_token_id, eos)
        texts = [tok.decode(r, skip_special_tokens=True) for r in rollout.responses]
        scores = scorer(rows, rollout, texts)
        for j, sample in enumerate(batch):
            rows_j = range(j * n, (j + 1) * n)
            answers = [texts[i] for i in rows_j]
            marks = [
                scores[i] if usable(texts[i], bool(rollout.finished[i]), cfg.keep_unfinished) else None for i in rows_j
            ]
            pick = (
                best_of_n(answers, marks, cfg.threshold)
                if cfg.mode == "sft"
                else best_and_worst(answers, marks, cfg.margin)
            )
            if pick is None:
                counts["skipped"] += 1
                counts["too_few"] += len(considered(answers, marks)) < (1 if cfg.mode == "sft" else 2)
                continue
            messages = rw.prompt_messages(sample)
            tools = json.loads(sample["conversation"]).get("tools")
            records.append(
                make_record(dpo_prompt(sample, messages), messages, answers, marks, cfg.mode, pick, tools=tools)
            )
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    counts["records"] = len(records)
    if scorer.judge is not None:
        counts.update({k.split("/")[-1]: v for k, v in scorer.judge.take_figures().items()})
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:

    try:
        cfg = load_config(SampleConfig, argv, prog="relay sample")
        problems = cfg.file_problems()
    except ConfigError as err:
        problems = err.problems
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        counts = run(cfg)
    except (DataError, JudgeError, OSError, ValueError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 1
    print(
        f"{cfg.out}: {counts['records']} {cfg.mode} records from {counts['prompts']} prompts; skipped: "
        f"{counts['skipped'] - counts['too_few']} "
        f"{'below the threshold' if cfg.mode == 'sft' else 'with no pair over the margin'}, "
        f"{counts['too_few']} with too few usable answers (left out: "
        f"{'empty ones' if cfg.keep_unfinished else 'empty ones and ones cut at max_new_tokens'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
