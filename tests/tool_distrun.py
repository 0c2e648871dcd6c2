"""The tool callers of the tool rollouts the tests run through a stage (tests/cells_distrun.py,
tests/test_cells.py, tests/test_cells_ddp.py, tests/test_tool_rollout.py): `Scripted`, a pure
function of each context (and of a row's place among the identical contexts of one call, which
tells the G copies of a prompt apart), so the rollouts do not depend on how prompts are dealt to
ranks; `ForcedFirstCall`, a real sampler whose first turn is a fixed call.
"""

from __future__ import annotations


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


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
"""A call to tests/test_tool_rollout.py's add(2, 3) in Relay's layout (what the tiny model's template reads)."""


def call_length(tok) -> int:
    """The tokens of `CALL`'s turn (its EOS included): a completion longer than that sampled a turn after it."""
    return len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1


class ForcedFirstCall:
    """The stage's own sampler, except that each row's first turn is a fixed call (a random tiny
    policy never writes one); later turns are sampled."""

    def __init__(self, inner, tok, call: str = CALL):
        self.inner, self.tok = inner, tok
        self.call = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(self, prompts, max_new_tokens=None):
        limits = list(max_new_tokens or [64] * len(prompts))
        later = [i for i, p in enumerate(prompts) if self.tok.decode(p).count("<|im_start|>assistant") > 1]
        sampled = {}
        if later:
            sampled = dict(
                zip(later, self.inner.generate([prompts[i] for i in later], max_new_tokens=[limits[i] for i in later]))
            )
        return [sampled[i] if i in sampled else self.call[: limits[i]] for i in range(len(prompts))]
