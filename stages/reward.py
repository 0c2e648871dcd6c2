"""RM stage: a pairwise reward model on the previous stage's merged model.

    torchrun --nproc_per_node N stages/reward.py --config configs/rm.yaml [--train.max_steps 20]
    python stages/reward.py                                 # one process, bundled sample data

A sequence classifier with one output (`score` head) on the SFT model; chosen and rejected
answers are rendered with the SFT chat template, each side ending at the end-of-turn token that
closes its answer, and scored there (`pipeline.scoring.reward_readout_index`, the token PPO reads).
`data.truncation: truncate` cuts the oldest prompt tokens, never the answer. Loss:
-logsigmoid(r_chosen - r_rejected - margin) (+ `reward.center_rewards_coefficient` *
mean((r_chosen + r_rejected)^2), InstructGPT/TRL's centring). With LoRA the head is trained in
full (modules_to_save) and survives the merge.

merged/ is a plain `AutoModelForSequenceClassification` folder; its manifest.json (`reward_stats`)
and config.json (`relay_reward_stats`) record the mean/std of its scores over the training
responses, so PPO can normalise rewards without recomputing them.

Checkpoint/resume, trackers and RELAY_STOP_AFTER_STEP=k behave as in the SFT stage (the shared
`pipeline.training.Run`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.config import ConfigError, PreferenceDataConfig, StageConfig, load_config, save_config
from pipeline.models import eval_mode
from pipeline.scoring import sequence_scores
from pipeline.training import (
    Run,
    build_run,
    clip_gradients,
    data_problems,
    eval_shards,
    finish,
    next_batches,
    parent_problems,
    end_of_step,
    stop_after_step,
    write_summary,
)

log = logging.getLogger("relay.rm")
STAGE = "rm"
REWARD_STATS_KEY = "relay_reward_stats"


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class RMData(PreferenceDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/rm/train.jsonl"])
    """Preference pairs: {question, response_chosen, response_rejected}, {prompt, chosen, rejected} or chat lists."""
    eval: list[str] = field(default_factory=lambda: ["data/sample/rm/valid.jsonl"])
    """Held-out pairs for eval/accuracy, eval/margin and eval/loss."""


@dataclass
class RewardSection:
    center_rewards_coefficient: Optional[float] = None
    """Weight of mean((r_chosen + r_rejected)^2), keeping scores centred on 0 (TRL uses 0.01). None: off."""
    stats_max_pairs: Optional[int] = None
    """Compute the stored reward statistics on at most this many training pairs (None: all)."""


@dataclass
class RMConfig(StageConfig):
    output_dir: str = "outputs/rm"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (PPO's reward model), summary.json."""
    data: RMData = field(default_factory=RMData)
    reward: RewardSection = field(default_factory=RewardSection)


@dataclass
class Prepared:
    tokenizer: object
    template: object
    train: list
    eval: list


def validate(cfg: RMConfig) -> Prepared:
    """Check config, data and the parent model's manifest; build the tokenised pairs.

    Raises:
        ConfigError: listing every problem found.
    """
    from data_formats.datasets import build_preference_data
    from data_formats.render import make_template
    from data_formats.sources import DataError
    from pipeline.models import load_tokenizer, resolve_model_path

    problems = cfg.problems() + data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
    if cfg.data.padding_mode != "padding":
        problems.append("data.padding_mode: the RM stage pads pairs ('padding'); packing is not supported")
    if cfg.reward.center_rewards_coefficient is not None and cfg.reward.center_rewards_coefficient < 0:
        problems.append("reward.center_rewards_coefficient: must be >= 0")
    model_path = resolve_model_path(cfg.model.path)
    problems += parent_problems(model_path)
    if problems:
        raise ConfigError(problems)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.model.revision)
    try:
        template = make_template(cfg.data, tokenizer)
        train = build_preference_data(cfg.data, tokenizer, template, cfg.train.seq_length, "train")
        has_eval = bool(cfg.data.eval) or cfg.data.eval_fraction > 0
        evaluation = build_preference_data(cfg.data, tokenizer, template, cfg.train.seq_length, "eval") if has_eval else []
    except (DataError, ValueError) as err:
        raise ConfigError([str(err)]) from err
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if len(train) < cfg.train.batch_size * world:
        raise ConfigError([f"data.train: {len(train)} pair(s) cannot fill one micro-batch of {cfg.train.batch_size} x {world} rank(s)"])
    return Prepared(tokenizer, template, train, evaluation)


# ------------------------------------------------------------------------------------------
# Pieces: batching, loss
# ------------------------------------------------------------------------------------------


@dataclass
class PairCollator:
    """Pairs -> one right-padded batch: rows [0, B) are the chosen sides, [B, 2B) the rejected ones,
    so one forward scores both."""

    pad_token_id: int

    def __call__(self, pairs: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        margin = torch.tensor([float(p.get("margin") or 0.0) for p in pairs], dtype=torch.float32)
        return {"input_ids": ids, "attention_mask": mask, "margin": margin}


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: Optional[torch.Tensor] = None,
                  center_coef: Optional[float] = None) -> torch.Tensor:
    """mean(-logsigmoid(r_c - r_r - margin)) + center_coef * mean((r_c + r_r)^2)."""
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    return loss


def pair_scores(model, batch: dict, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of a PairCollator batch."""
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    with autocast:
        scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def _reduce_mean(values: dict[str, float], accelerator) -> dict[str, float]:
    if accelerator.num_processes == 1:
        return values
    keys = sorted(values)
    t = accelerator.reduce(torch.tensor([values[k] for k in keys], device=accelerator.device), reduction="mean")
    return dict(zip(keys, t.tolist()))


def rm_step(run: Run, batches: list[dict], step: int) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches (equal-sized, so the mean of per-batch
    means is the pair mean). Returns loss, accuracy and grad_norm averaged over ranks.

    Raises:
        NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
    """
    from pipeline.training import _is_deepspeed, check_finite

    acc, coef = run.accelerator, run.cfg.reward.center_rewards_coefficient
    scale = 1.0 if _is_deepspeed(acc) else 1.0 / len(batches)
    loss_total, correct = 0.0, 0.0
    for index, batch in enumerate(batches):
        sync = contextlib.nullcontext() if index == len(batches) - 1 else acc.no_sync(run.model)
        with sync:
            chosen, rejected = pair_scores(run.model, batch, acc)
            loss = pairwise_loss(chosen, rejected, batch["margin"], coef)
            acc.backward(loss * scale)
        loss_total += float(loss.detach()) / len(batches)
        correct += float((chosen > rejected).float().mean()) / len(batches)
    grad_norm = clip_gradients(run.model, acc, run.cfg.train.max_grad_norm)
    check_finite(loss_total, run.model, step)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return {**_reduce_mean({"loss": loss_total, "accuracy": correct}, acc), "grad_norm": grad_norm}


@torch.no_grad()
def score_pairs(run: Run, pairs: list, max_batches: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of `pairs`, gathered from every rank (padding batches excluded)."""
    acc = run.accelerator
    chosen, rejected = [], []
    collator = PairCollator(run.tokenizer.pad_token_id)
    for indices, counts in eval_shards(len(pairs), run.cfg.train.batch_size, acc.num_processes, acc.process_index, max_batches):
        batch = {k: v.to(acc.device) for k, v in collator([pairs[i] for i in indices]).items()}
        c, r = pair_scores(run.model, batch, acc)
        keep = torch.full_like(c, 1.0 if counts else float("nan"))
        chosen.append(c * keep)
        rejected.append(r * keep)
    c, r = torch.cat(chosen), torch.cat(rejected)
    if acc.num_processes > 1:
        c, r = acc.gather_for_metrics(c), acc.gather_for_metrics(r)
    ok = ~torch.isnan(c)
    return c[ok].cpu(), r[ok].cpu()


def evaluate(run: Run) -> Optional[dict]:
    """eval/accuracy, eval/margin (mean r_c - r_r), eval/loss on the held-out pairs; None without any."""
    if not run.eval_samples:
        return None
    with eval_mode(run.model):
        chosen, rejected = score_pairs(run, run.eval_samples, run.cfg.train.eval_batches)
    # eval/loss is the plain pairwise loss (no margin column, no centring), comparable across runs
    result = {"accuracy": float((chosen > rejected).float().mean()), "margin": float((chosen - rejected).mean()),
              "loss": float(pairwise_loss(chosen, rejected))}
    run.history.evals.append({"step": run.step, **result})
    run.tracker.log({f"eval/{k}": v for k, v in result.items()}, run.step)
    return result


def evaluate_and_check(run: Run) -> bool:
    """Evaluate; True when early stopping says stop (no eval data never stops)."""
    return run.early.update((evaluate(run) or {"loss": math.inf})["loss"])


def reward_stats(run: Run, max_pairs: Optional[int]) -> dict:
    """Mean and std of the trained model's scores over the training responses (both sides)."""
    pairs = run.train_samples[:max_pairs] if max_pairs else run.train_samples
    with eval_mode(run.model):
        chosen, rejected = score_pairs(run, pairs)
    scores = torch.cat([chosen, rejected]).double()
    return {"mean": float(scores.mean()), "std": float(scores.std(unbiased=False)), "n": int(scores.numel())}


def record_stats_in_config(merged: Path, stats: dict) -> None:
    """Add `relay_reward_stats` to merged/config.json (written beside it, then renamed)."""
    path = merged / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config[REWARD_STATS_KEY] = stats
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)


# ------------------------------------------------------------------------------------------
# Setup, train, finish
# ------------------------------------------------------------------------------------------


def setup(cfg: RMConfig, prepared: Prepared) -> Run:
    """Accelerator, reward model (num_labels=1 head; LoRA adds it to modules_to_save), optimizer,
    scheduler, trackers; resume if due."""
    from data_formats.render import template_jinja

    run = build_run(cfg, STAGE, tokenizer=prepared.tokenizer, collator=PairCollator(prepared.tokenizer.pad_token_id),
                    train_samples=prepared.train, eval_samples=prepared.eval, tasks=["default"],
                    chat_template=template_jinja(prepared.template, prepared.tokenizer), model_kind="reward")
    if run.is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
        log.info("rm: %d training pair(s), %d eval pair(s)", len(prepared.train), len(prepared.eval))
    return run


def train(run: Run) -> bool:
    """The training loop; False when stopped early by RELAY_STOP_AFTER_STEP.

    Raises:
        NonFiniteError: a NaN/inf loss or gradient.
    """
    t = run.cfg.train
    stop_at = stop_after_step()
    bar = tqdm(total=t.max_steps, initial=run.step, desc=STAGE, disable=not run.is_main)
    while run.step < t.max_steps:
        batches = next_batches(run)
        lr = run.scheduler.get_last_lr()[0]
        result = rm_step(run, batches, run.step + 1)
        run.scheduler.step()
        run.step += 1
        run.history.steps.append({"step": run.step, "lr": lr, **result})
        if run.step % t.log_steps == 0 or run.step == t.max_steps:
            run.tracker.log({"train/loss": result["loss"], "train/accuracy": result["accuracy"], "train/lr": lr,
                             "train/grad_norm": result["grad_norm"]}, run.step)
        bar.update(1)
        bar.set_postfix(loss=f"{result['loss']:.4f}", acc=f"{result['accuracy']:.2f}")
        outcome = end_of_step(run, stop_at, lambda: evaluate_and_check(run))
        if outcome == "interrupted":
            return False
        if outcome == "early_stop":
            break
    bar.close()
    if run.eval_samples and (not run.history.evals or run.history.evals[-1]["step"] != run.step):
        evaluate(run)
    return True


def summarize(run: Run, stats: dict, wall: float) -> dict:
    """summary.json's figures."""
    steps, evals = run.history.steps, run.history.evals
    last = evals[-1] if evals else {}
    return {
        "train_loss_first": steps[0]["loss"] if steps else None,
        "train_loss_last": steps[-1]["loss"] if steps else None,
        "train_accuracy_last": steps[-1]["accuracy"] if steps else None,
        "eval_accuracy": last.get("accuracy"),
        "eval_margin": last.get("margin"),
        "eval_loss_last": last.get("loss"),
        "eval_loss_first": evals[0]["loss"] if evals else None,
        "reward_stats": stats,
        "steps": run.step,
        "wall_seconds": wall,
    }


def run_stage(cfg: RMConfig) -> Run:
    """validate -> setup -> train -> reward stats -> merge (merged/ with reward_stats) -> summary."""
    started = time.time()
    prepared = validate(cfg)
    run = setup(cfg, prepared)
    if not train(run):
        return run
    stats = reward_stats(run, cfg.reward.stats_max_pairs)
    log.info("reward statistics over the training responses: %s", stats)
    merged = finish(run, extra_manifest={"reward_stats": stats})
    if run.is_main:
        record_stats_in_config(Path(merged), stats)
        write_summary(cfg.output_dir, summarize(run, stats, time.time() - started))
    run.accelerator.wait_for_everyone()
    return run


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(RMConfig, argv, prog="stages/reward.py")
        run_stage(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
