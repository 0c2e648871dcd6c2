"""What torch.compile of the decode step would pay on this machine (issue 22's open question).

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python bench/decode_compile.py [--batch 8] [--tokens 64]

Times Relay's decode engine (pipeline/modeling/decode.py) on the embedded model three ways, greedy,
every row exactly `--tokens` new tokens: eager with prepacked weights (the default), eager without
(`RELAY_DECODE_PACKED=0`), and without prepacking with the model's forward under `torch.compile`
(inductor). Prints the compile time (the first call's extra seconds), the per-token times and the
break-even: how many generated tokens the compile needs to pay for itself against the default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(model, prompts, tokens: int, eos: int, pad: int) -> float:
    from pipeline.modeling.decode import generate

    started = time.perf_counter()
    out = generate(
        model, prompts, max_new_tokens=tokens, eos_ids=[eos], pad_id=pad, temperature=0.0, min_new_tokens=tokens
    )
    assert all(len(r) == tokens for r in out.tokens)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modeling.embedded import materialize

    path = materialize()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = [f"Question {i}: what is the capital of the island number {i}?" for i in range(args.batch)]
    prompts = [tok(t)["input_ids"] for t in text]
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    result = {"batch": args.batch, "tokens": args.tokens, "threads": torch.get_num_threads()}
    os.environ["RELAY_DECODE_PACKED"] = "1"  # the packed row is packed whatever this CPU's measured choice
    with torch.no_grad():
        timed(model, prompts, 4, eos, pad)
        result["packed_s"] = timed(model, prompts, args.tokens, eos, pad)
        os.environ["RELAY_DECODE_PACKED"] = "0"
        timed(model, prompts, 4, eos, pad)
        result["eager_s"] = timed(model, prompts, args.tokens, eos, pad)
        model.forward = torch.compile(model.forward, dynamic=False)
        try:
            first = timed(model, prompts, args.tokens, eos, pad)
            again = timed(model, prompts, args.tokens, eos, pad)
            result.update(compiled_first_s=first, compiled_s=again, compile_s=first - again)
        except Exception as err:  # the measurement reports a failing compile instead of hiding it
            result["compile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    per_token = {k: result[k] / args.tokens for k in ("packed_s", "eager_s", "compiled_s") if k in result}
    result["ms_per_step"] = {k: round(v * 1000, 1) for k, v in per_token.items()}
    if "compiled_s" in per_token and per_token["compiled_s"] < per_token["packed_s"]:
        result["break_even_tokens"] = round(result["compile_s"] / (per_token["packed_s"] - per_token["compiled_s"]))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
