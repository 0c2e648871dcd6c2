"""The decode session (pipeline/modeling/decode_session.py), which keeps a batch's KV cache across a
tool rollout's turns, against the engine's fresh calls (`decode.generate` on the whole
conversations, the path every turn took before) and against transformers' plain forward:

- three calls (all rows; two rows continued with inserted ids of different lengths; one row whose
  context replaces part of its cached tokens) sample the same ids as `decode.generate` from the
  same RNG, with the same log-probs (1e-6), on the fast step and on the model's own forward;
- every listed row's logits at every step equal a plain forward of that row's whole context alone.
"""

from __future__ import annotations

import pytest
import torch
from tinymodels import make_tiny_model
from transformers import AutoModelForCausalLM

from pipeline.modeling.decode import generate
from pipeline.modeling.decode_session import DecodeSession, common_prefix, supported
from pipeline.modeling.decode_steps import FastStep

EOS = [9, 13]
PROMPTS = [[5, 9, 17, 30, 4, 8, 3], [11, 12], [7, 7, 20, 25], [31, 8, 6, 44, 40]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("session") / "tiny", seed=3, vocab_size=48)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _calls(first: list[list[int]]):
    """The three calls' (rows, contexts, limits), given the first call's samples."""
    second_rows = [1, 3]
    inserted = {1: [40, 41, 42], 3: [43, 44, 45, 46, 47, 20, 21]}
    second = [PROMPTS[r] + first[r] + inserted[r] for r in second_rows]
    return second_rows, second, [9, 6]


def _scenario(sample):
    """Runs the three calls through `sample(rows, contexts, limits) -> (tokens, logprobs)`."""
    torch.manual_seed(7)
    first = sample([0, 1, 2, 3], PROMPTS, [10, 10, 4, 10])
    rows2, ctx2, lim2 = _calls(first[0])
    second = sample(rows2, ctx2, lim2)
    # row 3's third context keeps its prompt and first turn but replaces everything after them
    ctx3 = [PROMPTS[3] + first[0][3] + [30, 31]]
    third = sample([3], ctx3, [8])
    return [first, second, third], [PROMPTS, ctx2, ctx3]


@pytest.mark.parametrize("kind", ["fast", "hf", "static"])
def test_kept_cache_samples_what_fresh_calls_sample(tiny, kind, monkeypatch):
    """kind: the decode step (the fast step of a CPU in fp32; the model's own forward; the CUDA
    graph's fixed-shape step, uncaptured)."""
    monkeypatch.setenv("RELAY_DECODE_PACKED", "0" if kind == "hf" else "1")
    session = DecodeSession(tiny, 4, eos_ids=EOS, pad_id=0, temperature=0.8, logprobs=True, kind=kind)
    seen = []

    def kept(rows, contexts, limits):
        before = [len(session.logprobs[r]) for r in rows]
        steps = []
        tokens = session.generate(rows, contexts, limits, on_logits=lambda s, logits: steps.append(logits.clone()))
        seen.append((contexts, tokens, steps))
        return tokens, [session.logprobs[r][n:] for r, n in zip(rows, before)]

    def fresh(rows, contexts, limits):
        out = generate(tiny, contexts, max_new_tokens=limits, eos_ids=EOS, pad_id=0, temperature=0.8, logprobs=True)
        return out.tokens, out.logprobs

    got, contexts = _scenario(kept)
    want, want_contexts = _scenario(fresh)
    assert {
        "fast": isinstance(session.step, FastStep),
        "hf": session.step is False,
        "static": callable(session.step) and not isinstance(session.step, FastStep),
    }[kind]
    assert contexts == want_contexts
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert tokens == ref_tokens
        for a, b in zip(logprobs, ref_logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    lengths = [len(t) for t in got[0][0]]
    assert min(lengths) < max(lengths) and any(t[-1] in EOS for t in got[0][0])  # ragged ends: idle rows happened
    assert session.capacity > len(PROMPTS[0]) + 10  # the cache grew for the later calls
    # every step's logits against a plain forward of the row's whole context alone (transformers)
    for contexts, tokens, steps in seen:
        for step, logits in enumerate(steps):
            for i, (context, sampled) in enumerate(zip(contexts, tokens)):
                if step < len(sampled):
                    with torch.no_grad():
                        full = tiny(torch.tensor([list(context) + sampled[:step]])).logits[0, -1]
                    torch.testing.assert_close(logits[i], full, atol=1e-5, rtol=0)


def test_rules_and_helpers(tiny):
    assert (
        common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
        and common_prefix([], [1]) == 0
        and common_prefix([1, 2], [1, 2]) == 2
    )
    assert supported(tiny)
    session = DecodeSession(tiny, 2, eos_ids=EOS, pad_id=0)
    with pytest.raises(ValueError, match="first call must list every row"):
        session.generate([0], [[5, 6]], [3])
    with pytest.raises(ValueError, match="non-empty context"):
        session.generate([0, 1], [[5, 6], []], [3, 3])
