"""The scripted tool caller of the two-rank tool rollouts (tests/cells_distrun.py, for
tests/test_cells_ddp.py's GRPO and PPO runs with tools): a pure function of each context (and of a
row's place among the identical contexts of one call, which tells the G copies of a prompt apart),
so the rollouts do not depend on how prompts are dealt to ranks.
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
