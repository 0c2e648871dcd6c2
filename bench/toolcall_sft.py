"""Outcome figure: does a short SFT on tool-calling conversations teach the embedded model to call?

    OMP_NUM_THREADS=1 python bench/toolcall_sft.py [--steps 40] [--out outputs/toolcall_sft]

Writes tool-calling conversations in the demo's style (the Kelvra Archipelago of
data/make_sample.py: one tool, `island_fact(island, attribute)`, the ShareGPT shape with
function_call/observation turns and a `tools` list), trains the embedded SmolLM2-135M on them
with the SFT stage (LoRA, the config's defaults otherwise; the embedded template has no tool
support, so Relay's default tool layout is used and saved into merged/), then asks held-out
requests (islands never seen in training) of the base model and of merged/, each rendered by the
model folder's own chat template with `tools=` (the saved one for merged/), greedy. A reply counts
as a parseable call when it holds <tool_call>{json}</tool_call> with a `name` and an `arguments`
object; a correct call also names island_fact with the asked island and attribute. Prints one
line per model and a JSON summary. Not a test: a few minutes of CPU.

Measured 2026-11-24 (defaults: 16 steps of batch 2, LoRA, lr 2e-3; a shared 2-core CPU,
OMP_NUM_THREADS=1, 7 min wall in all): base 0/12 parseable calls (0 correct); after SFT 10/12
parseable calls, 6/12 correct (train loss 1.79 -> 0.002).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_formats.sample_world import KELVRA_FACTS  # noqa: E402  (the demo's island table)

TOOL = {
    "name": "island_fact",
    "description": "Look up one fact about an island of the Kelvra Archipelago",
    "parameters": {
        "type": "object",
        "properties": {
            "island": {"type": "string", "description": "The island's name"},
            "attribute": {"type": "string", "enum": ["capital", "export", "lighthouses", "festival"]},
        },
        "required": ["island", "attribute"],
    },
}
ASK = {
    "capital": ["What is the capital of {i}?", "Which town is the capital of {i}?"],
    "export": ["What does {i} mainly export?", "What is the main export of {i}?"],
    "lighthouses": ["How many lighthouses does {i} have?", "Count the lighthouses on {i} for me."],
    "festival": ["In which month is the lantern festival on {i}?", "When does {i} hold its lantern festival?"],
}
ATTRS = ("capital", "export", "lighthouses", "festival")
HELD_OUT = ("Haldra", "Fenwick Reach", "Ebbmoor")


def record(island: str, attribute: str, phrase: str) -> dict:
    value = KELVRA_FACTS[island][ATTRS.index(attribute)]
    call = {"name": "island_fact", "arguments": {"island": island, "attribute": attribute}}
    return {
        "conversations": [
            {"from": "human", "value": phrase.format(i=island)},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": json.dumps({"value": value})},
            {"from": "gpt", "value": f"Per the Kelvra Atlas, the {attribute} of {island} is {value}."},
        ],
        "tools": json.dumps([TOOL]),
    }


def write_data(folder: Path) -> list[tuple[str, str, str]]:
    """Training file (every seen island x attribute x phrasing); returns the held-out requests."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [record(i, a, p) for i in KELVRA_FACTS if i not in HELD_OUT for a in ATTRS for p in ASK[a]]
    random.Random(0).shuffle(rows)
    (folder / "toolcall.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return [(i, a, ASK[a][0]) for i in HELD_OUT for a in ATTRS]


def parse_call(reply: str):
    """The first <tool_call> JSON of a reply as a dict with name/arguments, or None."""
    match = re.search(r"<tool_call>(.*?)</tool_call>", reply, flags=re.S)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    ok = isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)
    return call if ok else None


def score(folder: str, requests) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    parseable = correct = 0
    for island, attribute, phrase in requests:
        messages = [{"role": "user", "content": phrase.format(i=island)}]
        ids = tok.apply_chat_template(
            messages,
            tools=[{"type": "function", "function": TOOL}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        reply = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        call = parse_call(reply)
        parseable += call is not None
        correct += (
            call is not None
            and call["name"] == "island_fact"
            and call["arguments"] == {"island": island, "attribute": attribute}
        )
    return {"requests": len(requests), "parseable": parseable, "correct": correct}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default="outputs/toolcall_sft")
    args = parser.parse_args()
    from pipeline.modeling.embedded import materialize

    out = Path(args.out)
    requests = write_data(out / "data")
    base = str(materialize())
    before = score(base, requests)
    print(
        f"before (embedded base): {before['parseable']}/{before['requests']} "
        f"parseable calls, {before['correct']} correct",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "stages/sft.py"),
            "--model.path",
            "embedded",
            "--output_dir",
            str(out / "sft"),
            "--data.train",
            f"[{out / 'data'}]",
            "--data.eval",
            "[]",
            "--train.max_steps",
            str(args.steps),
            "--train.batch_size",
            "2",
            "--train.grad_accum",
            "1",
            "--train.seq_length",
            "512",
            "--train.learning_rate",
            "2e-3",
            "--train.warmup",
            "2",
            "--train.log_steps",
            "10",
            "--checkpoint.save_interval",
            "1000h",
            "--tracking.trackers",
            "[]",
        ],
        check=True,
        cwd=ROOT,
    )
    after = score(str(out / "sft" / "merged"), requests)
    print(
        f"after {args.steps} SFT steps: {after['parseable']}/{after['requests']} "
        f"parseable calls, {after['correct']} correct",
        flush=True,
    )
    print(json.dumps({"steps": args.steps, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
