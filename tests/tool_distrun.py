"""One GRPO run with tools, under torchrun or in one process, for tests/test_tool_rollout.py's
2 ranks = 1 rank test.

    torchrun --nproc_per_node 2 tests/tool_distrun.py OUT MODEL PROMPTS BATCH

The sampler is scripted and a pure function of each context (and of a row's place among the
identical contexts of one call, which tells the G copies of a prompt apart), so the rollouts do
not depend on how prompts are dealt to ranks; rank 0 writes OUT/history.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for entry in (str(ROOT), str(ROOT / "tests")):
    if entry not in sys.path:
        sys.path.insert(0, entry)


class Scripted:
    """Turn 1: a call add(a, b) from the prompt (b: the copy); turn 2: an answer from the result."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, max_new_tokens=None):
        out, seen = [], {}
        for i, ids in enumerate(prompts):
            copy = seen.setdefault(tuple(ids), 0)
            seen[tuple(ids)] += 1
            text = self.tok.decode(ids)
            if text.count("<|im_start|>assistant") == 1:
                turn = '<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>' % (len(ids) % 7, copy)
            else:
                result = int(text.rsplit("<tool_response>", 1)[-1].split("<", 1)[0])
                turn = "The sum is" + " so" * (result % 3) + f" {result}."  # the copies' lengths (rewards) differ
            turn_ids = self.tok(turn, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(turn_ids[: max_new_tokens[i]] if max_new_tokens is not None else turn_ids)
        return out


def main(out: str, model: str, prompts: str, batch: int) -> None:
    from stagerun import run_stage
    from transformers import AutoTokenizer

    from stages import grpo

    cfg = grpo.GRPOConfig(output_dir=out)
    cfg.model.path = model
    cfg.data.train, cfg.data.eval = [prompts], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.learning_rate, cfg.train.max_steps = 0, batch, 1e-2, 2
    cfg.train.lr_schedule, cfg.train.warmup = "constant", 0
    cfg.lora.r = 4
    cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty = 64, None
    cfg.grpo.num_generations, cfg.grpo.beta = 2, 0.1
    cfg.grpo.reward_funcs = ["test_tool_rollout:answer_length"]
    cfg.tools.funcs = ["test_tool_rollout:add"]
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    tok = AutoTokenizer.from_pretrained(model)
    steps = []
    stage = run_stage(
        grpo.GRPOStage,
        cfg,
        generator_factory=lambda policy: Scripted(tok),
        on_step=lambda st, m: steps.append(
            {k: m[k] for k in ("train/loss", "train/grad_norm", "grpo/reward", "grpo/kl")}
        ),
    )
    if stage.accelerator.process_index == 0:
        (Path(out) / "history.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
