"""Outcome: does tool GRPO raise the success rate over tool SFT on a task that needs the tool?

    OMP_NUM_THREADS=1 python bench/tool_grpo.py [--model embedded] [--sft-steps 2] [--grpo-steps 16]
        [--grpo-lr 1e-4] [--temperature 0.5] [--seeds 0 1 2 3 4] [--eval 48] [--out outputs/tool_grpo] [--skip-base]

The task: add two 5-digit numbers, too long for a 135M model to add in its head; the tool is
`data_formats.sample_world:add`. Tool SFT trains on OpenAI-shaped conversations (question,
a call, the result, "The answer is N."), 2 steps on purpose: its greedy success stays low (0.10-0.17;
it mostly adds in its head), which leaves GRPO room (3 steps already give 0.98-1.00). Tool GRPO then
starts from it (tools.funcs [add], reward `final_answer_match` on the records' `answer`, G 4,
sampled at T 0.5: at T 1 the 2-step SFT model was never right, so no reward varied but
`missing_eos`). Success on held-out questions (`--eval` questions neither trainer saw) is
measured through `relay chat`'s tool loop (greedy, the real tool, the folder's own template; all
questions decoded as one batch per turn): the final answer must state the sum. Seeds can run as
parallel jobs (`--seeds k --skip-base`, one `--out` each). Prints
the base, SFT and GRPO success of every seed, then their mean and spread. Not a test: about 8 min
of CPU a seed on a 2-core CPU (minutes in all on a GPU). Its results, with the machine they ran
on, are in bench/RESULTS.md, "Tool use".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADD = "data_formats.sample_world:add"


def question(rng: random.Random) -> tuple[str, int, int]:
    a, b = rng.randint(10000, 99999), rng.randint(10000, 99999)
    return f"What is {a} + {b}?", a, b


def write_data(folder: Path, n_train: int, n_eval: int) -> list[dict]:
    """SFT conversations and GRPO prompts (disjoint questions); returns the held-out prompts."""
    from data_formats.sample_world import add
    from pipeline.rl.tool_rollout import derive_schema

    tools = [{"type": "function", "function": derive_schema(add)}]
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    sft, prompts = [], []
    for i in range(n_train + 2 * n_eval):
        text, a, b = question(rng)
        if i < n_train:
            call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
            sft.append(
                {
                    "messages": [
                        {"role": "user", "content": text},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": str(a + b)},
                        {"role": "assistant", "content": f"The answer is {a + b}."},
                    ],
                    "tools": tools,
                }
            )
        else:
            prompts.append({"messages": [{"role": "user", "content": text}], "answer": str(a + b)})
    (folder / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (folder / "grpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts[:n_eval]))
    return prompts[n_eval:]


def success(folder: str, held_out: list[dict], base: bool = False, temperature: float = 0.0, seed: int = 0) -> float:
    """Share of held-out questions whose final answer (after any tool calls) states the sum: `relay
    chat`'s tool loop (pipeline/tools/chat_tools.answer_with_tools: the folder's own template,
    greedy, 64 tokens a turn, the real tool, at most MAX_TURNS turns) run over all questions at once,
    each turn one batched greedy decode (the loop one question at a time costs a decode per turn
    per question: most of the bench's time before). `temperature` > 0: sampled answers (torch
    seeded with `seed`), what GRPO optimises, where greedy success is saturated."""
    import torch

    from data_formats.render import make_template, template_jinja
    from data_formats.tools import parse_answer
    from pipeline.algorithms.rewards import final_answer_match
    from pipeline.config import ChatDataConfig, ToolsConfig
    from pipeline.modeling.decode import generate
    from pipeline.rl.tool_rollout import load_tools
    from pipeline.tools.chat import eos_ids_of, load_chat_model, prompt_ids
    from pipeline.tools.chat_tools import MAX_TURNS, assistant_message, results

    chat = load_chat_model(folder)
    tok = chat.tokenizer
    if base:  # the base template has no tools: show them in the layout SFT will train
        tok.chat_template = template_jinja(make_template(ChatDataConfig(), tok), tok, tools=True)
    tools = load_tools(ToolsConfig(funcs=[ADD]))
    schemas, eos = [t.schema for t in tools.values()], eos_ids_of(chat.model, tok)
    torch.manual_seed(seed)
    histories = [list(p["messages"]) for p in held_out]
    open_rows = list(range(len(histories)))
    for _ in range(MAX_TURNS):
        if not open_rows:
            break
        out = generate(
            chat.model,
            [prompt_ids(tok, histories[i], schemas) for i in open_rows],
            max_new_tokens=64,
            eos_ids=eos,
            pad_id=tok.pad_token_id,
            temperature=temperature,
        )
        still = []
        for i, ids, ended in zip(open_rows, out.tokens, out.finished):
            text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=True).strip()
            parsed = parse_answer(text)
            if not parsed.has_calls:
                histories[i].append(assistant_message(text, []))
                continue
            histories[i].append(assistant_message(parsed.content, parsed.calls))
            histories[i] += [
                {"role": "tool", "content": r} for r in results(parsed.calls, parsed.errors, tools, 10.0, input)
            ]
            still.append(i)
        open_rows = still
    hits = [final_answer_match([], [h[1:]], answer=[p["answer"]])[0] for h, p in zip(histories, held_out)]
    return sum(hits) / len(held_out)


def stage(script: str, *argv: str) -> None:
    common = [
        "--checkpoint.save_interval",
        "1000h",
        "--tracking.trackers",
        "[]",
        "--data.eval",
        "[]",
        "--train.eval_steps",
        "0",
    ]
    subprocess.run([sys.executable, str(ROOT / "stages" / script), *argv, *common], check=True, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument(
        "--sft-steps", type=int, default=2, help="short on purpose: greedy success stays low (GRPO's room)"
    )
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--grpo-steps", type=int, default=16)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument(
        "--temperature", type=float, default=0.5, help="GRPO's sampling temperature (its log-probs use the same)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=48)
    parser.add_argument("--out", default="outputs/tool_grpo")
    parser.add_argument(
        "--skip-base", action="store_true", help="leave out the base model's row (seeds run as parallel jobs)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    held_out = write_data(out / "data", args.train, args.eval)
    from pipeline.modeling.embedded import resolve_model_path

    rows = {
        "base": [] if args.skip_base else [success(resolve_model_path(args.model), held_out, base=True)],
        "sft": [],
        "grpo": [],
    }
    if rows["base"]:
        print(f"base: {rows['base'][0]:.3f}", flush=True)
    for seed in args.seeds:
        sft, grpo = out / f"sft-{seed}", out / f"grpo-{seed}"
        stage(
            "sft.py",
            "--model.path",
            args.model,
            "--output_dir",
            str(sft),
            "--data.train",
            f"[{out / 'data' / 'sft.jsonl'}]",
            "--train.max_steps",
            str(args.sft_steps),
            "--train.batch_size",
            "2",
            "--train.seq_length",
            "512",
            "--train.learning_rate",
            str(args.sft_lr),
            "--train.warmup",
            "0",
            "--train.seed",
            str(seed),
        )
        stage(
            "grpo.py",
            "--model.path",
            str(sft / "merged"),
            "--output_dir",
            str(grpo),
            "--data.train",
            f"[{out / 'data' / 'grpo.jsonl'}]",
            "--train.max_steps",
            str(args.grpo_steps),
            "--train.batch_size",
            "2",
            "--train.seq_length",
            "512",
            "--train.learning_rate",
            str(args.grpo_lr),
            "--train.seed",
            str(seed),
            "--generation.max_new_tokens",
            "96",
            "--generation.temperature",
            str(args.temperature),
            "--grpo.num_generations",
            "4",
            "--grpo.reward_funcs",
            "[pipeline.algorithms.rewards:final_answer_match]",
            "--tools.funcs",
            f"[{ADD}]",
        )
        rows["sft"].append(success(str(sft / "merged"), held_out))
        rows["grpo"].append(success(str(grpo / "merged"), held_out))
        print(f"seed {seed}: sft {rows['sft'][-1]:.3f}, grpo {rows['grpo'][-1]:.3f}", flush=True)
    summary = {k: {"mean": statistics.mean(v), "spread": (min(v), max(v)), "runs": v} for k, v in rows.items() if v}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
