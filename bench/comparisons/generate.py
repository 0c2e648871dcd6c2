"""Decoding: Relay's engine (pipeline/modeling/decode.py) vs transformers' `model.generate`, with
its default dynamic KV cache (cases `-dynamic`) and with its own static cache
(`cache_implementation="static"`, cases `-static`); tokens/s and peak RSS, at batch 1, 8 and 32
and 24, 128 and 512 new tokens.

    .venv/bin/python bench/run.py generate [--quick] [--threads N] [--case b8-n128-dynamic]

Both sides: the harness's model (the embedded SmolLM2-135M-Instruct; `--quick` a tiny random
Llama) in fp32 with sdpa attention, the first `batch` gold prompts (data/sample/gold/eval.jsonl)
rendered by the model's chat template and left-padded, greedy, every row decoding exactly
`new_tokens` tokens (EOS masked out until then: transformers' `min_new_tokens`, the engine's
`min_new_tokens`), so both sides produce the same number of tokens; each side checks it did.
A side runs one short warm-up call (8 tokens), then the timed call. The model's weights are frozen,
as Relay's inference tools (chat, serve, the gold table) load a model: Relay's engine keeps the
prepacked copy of frozen weights between calls (a trainable weight it repacks every call, ~80 ms
for the embedded model).

The roofline (Relay's side, in the row's last-but-two cell and the JSON): one decode step must
read every weight once, so it takes at least (bytes of weights read per step) / (memory bandwidth,
harness.stream_bandwidth: a STREAM-like copy), and `batch` tokens per step can go no faster than
batch / that. The row gives that limit and Relay's share of it.
"""

from __future__ import annotations

from bench import harness

PEER = "transformers generate"
PEER_PYTHON = "relay"
UNIT = "tok/s"
LOSS_TOLERANCE = None
WHY_NO_LOSS = "greedy, equal token counts checked"
GOLD = harness.ROOT / "data" / "sample" / "gold" / "eval.jsonl"
WARMUP_TOKENS = 8


def cases(quick: bool) -> list[dict]:
    sizes = [(2, 4)] if quick else [(b, n) for b in (1, 8, 32) for n in (24, 128, 512)]
    return [
        {"case": f"b{b}-n{n}-{cache}", "batch": b, "new_tokens": n, "cache": cache, "warmup": 1}
        for b, n in sizes
        for cache in ("dynamic", "static")
    ]


def _setup(env: harness.SideEnv, batch: int):
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.modeling.models import load_tokenizer
    from pipeline.tools.chat import prompt_ids
    from pipeline.tools.gold import load_gold, messages_of

    torch.set_num_threads(env.threads)
    tokenizer = load_tokenizer(env.model)
    model = AutoModelForCausalLM.from_pretrained(env.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.requires_grad_(False)  # as Relay's inference tools load it (chat, serve, gold); generate does not care
    records = load_gold(GOLD)
    prompts = [prompt_ids(tokenizer, messages_of(records[i % len(records)])) for i in range(batch)]
    return model, tokenizer, prompts


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied head is the embedding,
    read once), less an untied input embedding, of which a step reads only `batch` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed is head else total - embed.numel() * embed.element_size()


def _check(case: dict, rows: list[list[int]]) -> None:
    if len(rows) != case["batch"] or any(len(r) != case["new_tokens"] for r in rows):
        raise harness.HarnessError(
            f"generate {case['case']}: rows of {sorted({len(r) for r in rows})} tokens, "
            f"wanted {case['batch']} x {case['new_tokens']}"
        )


def _timed(case: dict, clock, call) -> None:
    """A warm-up call, then the measured one; both marked on `clock`, the rows checked."""
    clock.start()
    call(WARMUP_TOKENS)
    clock.mark(case["batch"] * WARMUP_TOKENS)
    rows = call(case["new_tokens"])
    clock.mark(case["batch"] * case["new_tokens"])
    _check(case, rows)


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    from pipeline.modeling.decode import generate

    model, tok, prompts = _setup(env, case["batch"])
    clock = harness.StepClock()

    def call(n: int) -> list[list[int]]:
        return generate(
            model,
            prompts,
            max_new_tokens=n,
            eos_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
            temperature=0.0,
            min_new_tokens=n,
        ).tokens

    _timed(case, clock, call)
    bandwidth, read = harness.stream_bandwidth(), weight_bytes(model)
    return clock.result(
        None, weight_bytes=read, bandwidth_bytes_per_s=bandwidth, roofline_tok_s=case["batch"] * bandwidth / read
    )


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    import torch
    from transformers import GenerationConfig

    from data_formats.collate import left_pad

    model, tok, prompts = _setup(env, case["batch"])
    ids, mask = left_pad(prompts, tok.pad_token_id)
    clock = harness.StepClock()

    def call(n: int) -> list[list[int]]:
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            repetition_penalty=1.0,
            cache_implementation="static" if case["cache"] == "static" else None,
        )
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[
                :, ids.shape[1] :
            ].tolist()

    _timed(case, clock, call)
    return clock.result(None)


def note(ours: harness.SideResult, theirs: harness.SideResult) -> str:
    """The row's roofline cell: the limit and Relay's share of it."""
    _, rate = harness.timed(ours, 1)
    limit = ours.extra["roofline_tok_s"]
    return (
        f"n/a ({WHY_NO_LOSS}); roofline {limit:,.0f} tok/s ({ours.extra['weight_bytes'] / 1e6:,.0f} MB/step at "
        f"{ours.extra['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s): Relay at {rate / limit:.2f} of it"
    )
