"""`LanguageModelStage`: the shared half of the stages trained on next-token cross-entropy over
labelled tokens (PT and SFT): one token-normalised optimizer step over the accumulated batch
(`pipeline.engine.steps.lm_train_step`) and the held-out token loss, per task too."""

from __future__ import annotations

import math
import time
from typing import Optional

from pipeline.engine.held_out import eval_shards, held_out, token_loss_result, token_loss_sums
from pipeline.engine.stage import Stage
from pipeline.engine.steps import lm_train_step
from pipeline.modeling.models import eval_mode


class LanguageModelStage(Stage):
    """A subclass builds `self.collator` in `build_data` and may override `micro_batches` (PT's
    stream) and `task_weights` (SFT's multitask losses)."""

    collator = None

    def task_weights(self) -> Optional[list[float]]:
        """The next step's loss: None, the token mean over every task; else the mean of the tasks'
        token means weighted by these (one per task; `steps.token_weights`)."""
        return None

    def micro_batches(self) -> list[dict]:
        """This rank's micro-batches of the next optimizer step."""
        return [self.collate(self.collator, self.train_samples, group) for group in self.next_sample_indices()]

    def train_step(self) -> dict[str, float]:
        batches = self.micro_batches()
        weights = self.task_weights()
        started = time.perf_counter()
        result = lm_train_step(
            self.model,
            self.optimizer,
            batches,
            self.accelerator,
            step=self.step + 1,
            num_tasks=len(self.tasks),
            task_weights=weights,
            max_grad_norm=self.cfg.train.max_grad_norm,
        )
        seconds = time.perf_counter() - started
        self.history.tokens += result.tokens
        # Real tokens / token slots of this rank's batches (padding counts as waste).
        slots = sum(b["task_ids"].numel() for b in batches)
        figures = {
            "train/loss": result.loss,
            "train/grad_norm": result.grad_norm,
            "train/tokens_per_s": result.tokens / seconds if seconds > 0 else 0.0,
            "train/packing_efficiency": sum(int((b["task_ids"] >= 0).sum()) for b in batches) / slots,
        }
        if len(self.tasks) > 1:
            for name, value, tokens in zip(self.tasks, result.task_losses, result.task_tokens):
                if tokens > 0:
                    figures[f"train/loss_task/{name}"] = value
            for name, weight in zip(self.tasks, weights or []):
                figures[f"train/task_weight/{name}"] = weight
        return figures

    def heldout_losses(self, max_batches: Optional[int] = None, offset: int = 0) -> dict:
        """The held-out token loss, per task too (`token_loss_result`), over every rank's share of
        the evaluation batches; with `max_batches`, that many of them from batch `offset` on,
        rotating through the split (CoBa's measurements)."""
        acc, t = self.accelerator, self.cfg.train
        shards = eval_shards(len(self.eval_samples), t.batch_size, acc.num_processes, acc.process_index)
        if max_batches is not None and shards:
            shards = [shards[(offset + i) % len(shards)] for i in range(min(max_batches, len(shards)))]

        def figures(indices: list[int]) -> dict:
            batch = self.collate(self.collator, self.eval_samples, indices)
            return token_loss_sums(self.model, batch, acc, len(self.tasks))

        with eval_mode(self.model):
            return token_loss_result(held_out(shards, figures, acc), len(self.tasks))

    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/loss and eval/ppl on the held-out split (eval/loss_task/<task> with several tasks)."""
        if not self.eval_samples:
            return None
        result = self.heldout_losses(self.cfg.train.eval_batches)
        figures = {"eval/loss": result["loss"], "eval/ppl": result["ppl"]}
        if len(self.tasks) > 1:
            figures.update(
                {f"eval/loss_task/{n}": v for n, v in zip(self.tasks, result["task_losses"]) if math.isfinite(v)}
            )
        return figures
