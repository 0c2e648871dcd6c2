"""Cost of a tool GRPO step against a single-turn GRPO step at the same number of sampled tokens.

    OMP_NUM_THREADS=1 python bench/tool_step_cost.py [--model embedded] [--repeats 3]

The tool step: each completion's first turn is a call to `sample_world:add`, forced (the engine
runs a decode step per id, drawing from logits edited so that the call's next id is the only
choice: an untrained model writes no call), Relay runs it, inserts the result and the policy
samples the answer; once with the relay backend's session (each row's KV cache kept across turns,
pipeline/modeling/decode_session.py), once with every turn a fresh decode of the whole
conversation (the path before). The single-turn step then samples, for every row, exactly as many
tokens as that row sampled in the tool step (no EOS, per-row limits), from the same prompts. All
are whole `GRPOStage.train_step`s (rollout, rewards, update) on fresh stages, in one process;
prints each step's wall and CPU seconds (`time.process_time`: on a shared machine the wall clock
is mostly waiting) and the median ratios (the issue's goal: at most 1.5). Not a test. Its
results, with the machine they ran on, are in bench/RESULTS.md, "Tool use".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.rl.generators import RelayGenerator  # noqa: E402
from stages import grpo  # noqa: E402

CALL = '<tool_call>{"name": "add", "arguments": {"a": 48213, "b": 91877}}</tool_call>'


def zero_reward(prompts, completions, **columns):
    """Rewards that vary (so the update runs): the completion's length parity."""
    return [float(len(str(c)) % 2) for c in completions]


class ForcedFirstTurn:
    """A rollout's sampler whose first call (every row's first turn) is forced to the call's ids:
    the engine runs a decode step per id as for any sampled token (its cost), drawing from logits
    edited in place so that the call's next id is the only choice (an untrained model writes no
    call); later calls sample freely. `kept`: the relay backend's session (each row's KV cache
    kept across turns); otherwise every call is a fresh `decode.generate` of the whole
    conversations (the path before)."""

    def __init__(self, inner: RelayGenerator, tok, kept: bool):
        self.inner, self.kept, self.calls = inner, kept, 0
        self.call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def session(self, rows):
        self.engine, self.calls = self.inner.session(rows) if self.kept else None, 0
        return self

    def force(self, step, logits):
        if self.calls == 1 and step < len(self.call):
            logits.fill_(float("-inf"))[:, self.call[step]] = 0.0

    def generate(self, rows, contexts, max_new_tokens):
        from pipeline.modeling.decode import generate

        self.calls += 1
        limits = [len(self.call)] * len(rows) if self.calls == 1 else list(max_new_tokens)
        if self.engine is not None:
            return self.engine.generate(rows, contexts, limits, on_logits=self.force)
        g = self.inner
        return generate(
            g.model,
            contexts,
            max_new_tokens=limits,
            eos_ids=g.eos_ids,
            pad_id=g.pad_id,
            temperature=g.temperature,
            keep_packed=False,
            on_logits=self.force,
        ).tokens


class Exactly:
    """Single turn: each row samples the given number of tokens (EOS masked out until then)."""

    def __init__(self, inner: RelayGenerator, counts: list[int]):
        self.inner, self.counts = inner, counts

    def generate(self, prompts, max_new_tokens=None):
        from pipeline.modeling.decode import generate

        g = self.inner
        return generate(
            g.model,
            prompts,
            max_new_tokens=self.counts,
            eos_ids=g.eos_ids,
            pad_id=g.pad_id,
            temperature=g.temperature,
            keep_packed=False,
            min_new_tokens=max(self.counts),
        ).tokens


def config(out: Path, model: str, prompts: Path, tools: bool) -> grpo.GRPOConfig:
    cfg = grpo.GRPOConfig(output_dir=str(out))
    cfg.model.path = model
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.max_steps = 0, 2, 1
    cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty = 96, None
    cfg.grpo.num_generations, cfg.grpo.reward_funcs = 4, ["bench.tool_step_cost:zero_reward"]
    cfg.tools.funcs = ["data_formats.sample_world:add"] if tools else []
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    return cfg


def timed_step(cfg, factory) -> tuple[dict, object]:
    stage = grpo.GRPOStage(cfg, generator_factory=factory)
    stage.validate()
    stage.build()
    started, cpu = time.perf_counter(), time.process_time()
    stage.train_step()
    elapsed = {"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu}
    rollout = stage.last_rollout["rollout"]
    stage.release()
    return elapsed, rollout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relay-tool-cost-"))
    prompts = work / "prompts.jsonl"
    # both steps see the same prompts: the schema rides in the records, so the single-turn prompt has it too
    from data_formats.sample_world import add
    from pipeline.rl.tool_rollout import derive_schema

    schema = [{"type": "function", "function": derive_schema(add)}]
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"What is 48213 + 91877? ({i})"}], "tools": schema})
            + "\n"
            for i in range(2)
        )
    )
    from transformers import AutoTokenizer

    from pipeline.modeling.embedded import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    times: dict[str, list[dict]] = {"kept": [], "refill": [], "single": []}
    sampled = []
    for r in range(args.repeats):
        counts = None
        for kind in ("kept", "refill"):
            t_tool, rollout = timed_step(
                config(work / f"{kind}{r}", args.model, prompts, True),
                lambda policy, kept=(kind == "kept"): ForcedFirstTurn(
                    RelayGenerator(policy, tok.pad_token_id, [tok.eos_token_id], 96), tok, kept
                ),
            )
            got = rollout.response_mask.sum(1).tolist()
            assert counts is None or got == counts, "the kept cache sampled other tokens than the fresh calls"
            counts = got
            times[kind].append(t_tool)
        t_single, single = timed_step(
            config(work / f"single{r}", args.model, prompts, False),
            lambda policy: Exactly(RelayGenerator(policy, tok.pad_token_id, [tok.eos_token_id], 96), counts),
        )
        assert single.response_mask.sum(1).tolist() == counts
        times["single"].append(t_single)
        sampled.append(sum(counts))
        inserted = int(rollout.attention_mask[:, rollout.prompt_width :].sum() - rollout.response_mask.sum())
        print(
            f"repeat {r} ({sum(counts)} sampled, {inserted} inserted tokens), wall / CPU s of the steps: "
            + ", ".join(f"{k} {times[k][-1]['wall']:.2f} / {times[k][-1]['cpu']:.2f}" for k in times),
            flush=True,
        )
    ratios = {
        f"{clock}_{kind}": round(
            statistics.median(t[clock] for t in times[kind]) / statistics.median(t[clock] for t in times["single"]), 3
        )
        for clock in ("wall", "cpu")
        for kind in ("kept", "refill")
    }
    print(json.dumps({"times": times, "sampled_tokens": sampled, "median_ratio": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
