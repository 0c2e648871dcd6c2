"""Tool rollouts (pipeline/rl/tool_rollout.py): the call reader, running calls and their
failures, the multi-turn rollout's ids and train mask against transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` on a native template, token in token
out, the reward functions' messages, and GRPO steps with tools on a tiny model."""

from __future__ import annotations

import json
import time

import pytest
import torch
from tool_distrun import CALL, ForcedFirstCall
from transformers import AutoTokenizer

from data_formats.conversation import Conversation, Turn
from data_formats.render import make_template, render_prompt
from data_formats.tools import parse_answer, template_tools
from pipeline.algorithms import rewards as rw
from pipeline.config import ChatDataConfig, ToolsConfig
from pipeline.rl.tool_rollout import (
    ToolEnv,
    derive_schema,
    layout_problem,
    load_tools,
    run_calls,
    tool_rollout,
    tools_problems,
)

# ------------------------------------------------------------------------------------------
# Tools the tests call ("test_tool_rollout:<name>")
# ------------------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "woke"


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("no luck")


def undocumented(x):
    return x


# A Hermes/Qwen2.5-style ChatML template that renders tools, calls and results natively, with
# {% generation %} around what the assistant writes (what return_assistant_tokens_mask reads).
NATIVE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}{% if m.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}{% endif %}<|im_end|>{% endgeneration %}\n"
    "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _template(tok, native: bool):
    cfg = ChatDataConfig()
    if native:
        tok = _native(tok)
    return tok, make_template(cfg, tok)


def _native(tok):
    import copy

    tok = copy.deepcopy(tok)
    tok.chat_template = NATIVE
    return tok


class Scripted:
    """A Generator that answers turn k of every row with `turns[k]` (its canonical ids + EOS, or
    the ids given), cut to the row's limit; records what it was asked."""

    def __init__(self, tok, turns):
        self.tok, self.turns, self.asked = tok, turns, []

    def generate(self, prompts, max_new_tokens=None):
        out = []
        for i, ids in enumerate(prompts):
            k = self.tok.decode(ids).count("<|im_start|>assistant") - 1
            turn = self.turns[min(k, len(self.turns) - 1)]
            ids = (
                list(turn)
                if isinstance(turn, list)
                else self.tok(turn, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            )
            out.append(ids[: max_new_tokens[i]] if max_new_tokens is not None else ids)
        self.asked.append(list(max_new_tokens or []))
        return out


def _sample(tok, template, turns, tools):
    conv = Conversation(turns, tools=tools)
    return {
        "prompt_ids": render_prompt(conv, tok, template),
        "conversation": json.dumps({"turns": [t.__dict__ for t in conv.turns], "tools": tools}),
    }


def _env(tok, template, max_new_tokens=200, **cfg):
    tools_cfg = ToolsConfig(funcs=[f"test_tool_rollout:{n}" for n in ("add", "slow", "broken")], timeout=0.5, **cfg)
    tools = load_tools(tools_cfg)
    return ToolEnv(tok, template, tools, tools_cfg, tok.eos_token_id, tok.pad_token_id, max_new_tokens), tools


CALL_NATIVE = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CALL_LAYOUT = CALL


# ------------------------------------------------------------------------------------------
# The call reader and running calls
# ------------------------------------------------------------------------------------------


def test_reader_reads_both_layouts_and_names_each_broken_call():
    for text in (CALL_NATIVE, CALL_LAYOUT, "Let me add.\n" + CALL_LAYOUT):
        parsed = parse_answer(text)
        assert parsed.calls == [{"name": "add", "arguments": {"a": 2, "b": 3}}] and not parsed.errors
    assert parse_answer("Let me add.\n" + CALL_LAYOUT).content == "Let me add."
    bad = parse_answer(
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{oops</tool_call><tool_call>{'
    )
    assert bad.calls == [] and len(bad.errors) == 3 and bad.has_calls
    assert "'arguments' must be a JSON object" in bad.errors[0] and "not valid JSON" in bad.errors[1]
    assert "without </tool_call>" in bad.errors[2]
    assert not parse_answer("The answer is 5.").has_calls


def test_failures_become_error_results_and_a_slow_tool_does_not_block(tmp_path):
    tools = load_tools(ToolsConfig(funcs=[f"test_tool_rollout:{n}" for n in ("add", "slow", "broken")]))
    started = time.monotonic()
    results = run_calls(
        [
            {"name": "add", "arguments": {"a": 1, "b": 2}},
            {"name": "slow", "arguments": {"seconds": 5}},
            {"name": "broken", "arguments": {"x": 1}},
            {"name": "nope", "arguments": {}},
            {"name": "add", "arguments": {"a": 1, "c": 2}},
        ],
        tools,
        timeout=0.3,
    )
    assert time.monotonic() - started < 2.0  # the 5 s tool is abandoned at its limit
    assert results[0] == "3"
    assert results[1] == "error: 'slow' did not return within 0.3 s"
    assert results[2] == "error: 'broken' raised RuntimeError: no luck"
    assert results[3].startswith("error: unknown tool 'nope' (the tools are: add, broken, slow)")
    assert results[4].startswith("error: bad arguments for 'add':")


def test_schemas_are_transformers_and_config_problems_are_listed_together(tmp_path):
    from transformers.utils import get_json_schema

    expected = get_json_schema(add)["function"]
    expected.pop("return")
    assert derive_schema(add) == expected
    given = tmp_path / "schemas.json"
    given.write_text(
        json.dumps(
            [
                {
                    "type": "function",
                    "function": {
                        "name": "undocumented",
                        "description": "echo",
                        "parameters": {"type": "object", "properties": {}},
                    },
                }
            ]
        )
    )
    ok = ToolsConfig(funcs=["test_tool_rollout:add", "test_tool_rollout:undocumented"], schemas=str(given))
    assert tools_problems(ok) == [] and load_tools(ok)["undocumented"].schema["description"] == "echo"
    bad = ToolsConfig(
        funcs=[
            "test_tool_rollout:undocumented",
            "test_tool_rollout:missing",
            "x/y.py:f",
            "test_tool_rollout:add",
            "test_tool_rollout:add",
        ],
        max_turns=1,
        timeout=0,
    )
    found = bad.problems() + tools_problems(bad)
    assert len(found) == 6, found
    assert any("cannot read its schema" in p and "tools.schemas" in p for p in found)
    assert any("two tools are named 'add'" in p for p in found)


def test_the_layout_check_refuses_a_template_whose_calls_the_reader_cannot_read(tok):
    for native in (False, True):
        t, template = _template(tok, native)
        assert template.tools == ("native" if native else "layout")
        assert layout_problem(t, template) is None
    llama_like = _native(tok)
    llama_like.chat_template = NATIVE.replace("<tool_call>\n", "").replace("\n</tool_call>", "")
    template = make_template(ChatDataConfig(), llama_like)
    assert template.tools == "native"
    assert "does not read back" in layout_problem(llama_like, template)


# ------------------------------------------------------------------------------------------
# The rollout
# ------------------------------------------------------------------------------------------


def test_trained_positions_equal_transformers_assistant_mask_on_a_native_template(tok):
    """The rollout's whole ids and its train mask equal apply_chat_template(...,
    return_assistant_tokens_mask=True) of the same messages (transformers 5.24)."""
    t, template = _template(tok, native=True)
    env, tools = _env(t, template)
    schemas = [tool.schema for tool in tools.values()]
    sample = _sample(t, template, [Turn("system", "Be brief."), Turn("user", "What is 2 + 3?")], schemas)
    rollout = tool_rollout(Scripted(t, [CALL_NATIVE, "The sum is 5."]), [sample], env)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
    ] + rollout.conversations[0]
    assert rollout.conversations[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The sum is 5."},
    ]
    ref = t.apply_chat_template(
        messages, tools=template_tools(schemas), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    mask = [0] * len(sample["prompt_ids"]) + rollout.response_mask[0][: len(rollout.responses[0])].tolist()
    assert ids == ref["input_ids"]
    assert mask == ref["assistant_masks"]
    assert sum(mask) > 0 and rollout.finished.tolist() == [True]


def test_layout_rollout_ids_are_the_training_rendering(tok):
    """Relay's layout (a template without tool support): prompt + sampled + inserted ids equal the
    rendering training gives the same conversation, and the mask is its labels' mask."""
    from data_formats.render import render

    t, template = _template(tok, native=False)
    env, tools = _env(t, template)
    schemas = [tool.schema for tool in tools.values()]
    sample = _sample(t, template, [Turn("user", "What is 2 + 3?")], schemas)
    rollout = tool_rollout(Scripted(t, ["I will add.\n" + CALL_LAYOUT, "5"]), [sample, sample], env, copies=1)
    turns = [
        Turn("user", "What is 2 + 3?"),
        Turn("assistant", "I will add.", tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
        Turn("tool", "5"),
        Turn("assistant", "5"),
    ]
    ids, labels = render(Conversation(turns, tools=schemas), t, template)
    full = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    P = len(sample["prompt_ids"])
    # training also renders the "\n" after the last end-of-turn token, which a rollout never samples
    assert full == ids[: len(full)] and len(ids) - len(full) == len(t("\n", add_special_tokens=False)["input_ids"])
    assert rollout.response_mask[0][: len(full) - P].tolist() == [int(x != -100) for x in labels[P : len(full)]]


def test_dynamic_sampling_keeps_a_tool_rollouts_rows_as_sampled(tok):
    """GRPO's dynamic sampling lays kept rows of several rollouts out as one (rollout.take_rows): a
    tool rollout's inserted results stay untrained, its conversations, finished flags and calls follow."""
    from pipeline.rl.rollout import take_rows

    t, template = _template(tok, native=False)
    env, tools = _env(t, template)
    sample = _sample(t, template, [Turn("user", "What is 2 + 3?")], [tool.schema for tool in tools.values()])
    tool_run = tool_rollout(Scripted(t, ["I will add.\n" + CALL_LAYOUT, "5"]), [sample], env)
    plain_run = tool_rollout(Scripted(t, ["No tool needed: 5"]), [sample], env)
    for run in (plain_run, tool_run):  # an engine that reports its log-probs (vLLM): they follow their rows
        run.engine_logp = torch.randn(run.response_mask.shape)
    both = take_rows([(plain_run, 0), (tool_run, 0)], [sample["prompt_ids"]] * 2, t.pad_token_id)
    for row, source in enumerate((plain_run, tool_run)):
        n = len(source.responses[0])
        assert both.responses[row] == source.responses[0]
        assert both.response_mask[row, :n].tolist() == source.response_mask[0, :n].tolist()
        assert both.conversations[row] == source.conversations[0] and bool(both.finished[row]) == bool(
            source.finished[0]
        )
        assert (
            torch.equal(both.engine_logp[row, :n], source.engine_logp[0, :n])
            and both.engine_logp[row, n:].isnan().all()
        )
    assert 0 in both.response_mask[1, : len(tool_run.responses[0])].tolist()  # the inserted result, untrained
    assert both.tool_calls == [(0, 0), (1, 0)]  # each row's calls follow it (tools/call_frequency reads them)


def test_token_in_token_out(tok):
    """Sampled ids that are not the tokenizer's own split of their text: the rollout keeps them
    (what trains is what was sampled), while decoding and re-encoding would give other ids."""
    t, template = _template(tok, native=False)
    env, tools = _env(t, template)
    sample = _sample(t, template, [Turn("user", "Say hello.")], [tool.schema for tool in tools.values()])
    word = t(" hello", add_special_tokens=False)["input_ids"]
    assert len(word) == 1
    split = [t.convert_tokens_to_ids(p) for p in ("Ġhel", "lo")]
    assert t.decode(split) == " hello"
    sampled = split + [t.eos_token_id]
    rollout = tool_rollout(Scripted(t, [sampled]), [sample], env)
    assert rollout.responses[0] == sampled
    assert rollout.response_ids[0, : len(sampled)].tolist() == sampled  # what the update's forward and loss read
    assert t(t.decode(sampled), add_special_tokens=False)["input_ids"] != sampled  # re-tokenised: other ids


def test_limits_and_failures_end_or_continue_the_rollout(tok):
    t, template = _template(tok, native=False)
    schemas = [{"name": "add"}]
    sample = _sample(t, template, [Turn("user", "2 + 3?")], schemas)
    env, _ = _env(t, template, max_turns=2)
    always = Scripted(t, [CALL_LAYOUT])
    rollout = tool_rollout(always, [sample], env)  # the 2nd turn still calls: it ends there, no result after it
    assert [m["role"] for m in rollout.conversations[0]] == ["assistant", "tool", "assistant"]
    env, _ = _env(t, template, max_turns=4, max_tool_calls=1)
    rollout = tool_rollout(always, [sample], env)
    tool_results = [m["content"] for m in rollout.conversations[0] if m["role"] == "tool"]
    assert tool_results == [
        "5",
        "error: the limit of 1 tool calls per rollout is reached",
        "error: the limit of 1 tool calls per rollout is reached",
    ]
    assert rollout.tool_calls == [(3, 2)]  # every call answered; the two over the limit failed
    env, _ = _env(t, template)
    broken = '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>\n<tool_call>{nope</tool_call>'
    started = time.monotonic()
    rollout = tool_rollout(Scripted(t, [broken, "done"]), [sample], env)
    assert time.monotonic() - started < 3.0
    assert [m["content"] for m in rollout.conversations[0] if m["role"] == "tool"] == [
        "error: 'slow' did not return within 0.5 s",
        "error: tool call 2 is not valid JSON: Expecting property name enclosed in double quotes (column 2)",
    ]
    assert rollout.tool_calls == [(2, 2)]  # a timeout and an unreadable call
    first = len(t(broken, add_special_tokens=False)["input_ids"]) + 1
    env, _ = _env(
        t, template, max_new_tokens=first + 5
    )  # the results do not fit: the rollout ends at the call, unfinished
    rollout = tool_rollout(Scripted(t, [broken, "done"]), [sample], env)
    assert len(rollout.responses[0]) == first and rollout.response_mask[0].sum() == first
    assert rollout.finished.tolist() == [False] and [m["role"] for m in rollout.conversations[0]] == ["assistant"]


class PerRow:
    """Row i's first turn is `first[i]`; every later turn a plain answer."""

    def __init__(self, tok, first):
        self.tok, self.first = tok, first

    def generate(self, prompts, max_new_tokens=None):
        turns = self.first if len(prompts) == len(self.first) else ["done"] * len(prompts)
        return [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in turns]


def test_call_and_failure_frequency_are_trls(tok):
    """TRL's GRPOTrainer (1.16, installed: grpo_trainer.py's metrics) logs tools/call_frequency
    (calls summed over processes / every process's completions) and tools/failure_frequency
    (failed calls / calls, 0 without calls); its test's case, three completions, one of them
    calling a tool that works and one that does not, reads 2/3 and 1/2.
    The same rollout here gives the same figures; summed over two ranks, each holding such a
    batch, they do not change."""
    from types import SimpleNamespace

    from pipeline.rl.policy_stage import PolicyStage

    t, template = _template(tok, native=False)
    env, _ = _env(t, template)
    sample = _sample(t, template, [Turn("user", "2 + 3?")], [{"name": "add"}])
    both = CALL + '\n<tool_call>{"name": "missing", "arguments": {}}</tool_call>'
    rollout = tool_rollout(PerRow(t, [both, "no call", "no call"]), [sample] * 3, env)
    assert rollout.tool_calls == [(2, 1), (0, 0), (0, 0)]
    one = PolicyStage.tool_figures(SimpleNamespace(accelerator=None), rollout)
    assert one == {"tools/call_frequency": pytest.approx(2 / 3), "tools/failure_frequency": pytest.approx(1 / 2)}

    class TwoRanks:  # all_reduce_sum over two ranks holding the same rollout
        num_processes, device = 2, "cpu"

        def reduce(self, tensor, reduction):
            return tensor * 2

    assert PolicyStage.tool_figures(SimpleNamespace(accelerator=TwoRanks()), rollout) == one
    plain = tool_rollout(PerRow(t, ["no call"]), [sample], env)
    assert PolicyStage.tool_figures(SimpleNamespace(accelerator=None), plain) == {
        "tools/call_frequency": 0.0,
        "tools/failure_frequency": 0.0,
    }


def test_rewards_see_the_whole_conversation_and_final_answer_match_reads_the_last_turn():
    conversation = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    answered = conversation + [{"role": "assistant", "content": "It is 5."}]
    assert rw.final_answer_match([], [answered, conversation, "5 apples", "55"], answer=["5", "5", "5", "5"]) == [
        1.0,
        0.0,
        1.0,
        0.0,
    ]


# ------------------------------------------------------------------------------------------
# GRPO with tools (tiny policy)
# ------------------------------------------------------------------------------------------


def answer_length(prompts, completions, answer=None, **columns):
    """A reward that varies between samples: the final answer's length, and 1 for a tool result."""
    return [
        len(rw.final_answer(c)) / 10 + any(m["role"] == "tool" and m["content"] == "5" for m in c) for c in completions
    ]


def _grpo_cfg(out, policy, prompts, backend="relay"):
    from stages import grpo

    cfg = grpo.GRPOConfig(output_dir=str(out))
    cfg.model.path = str(policy)
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.learning_rate = 0, 2, 5e-3
    cfg.train.lr_schedule, cfg.train.warmup = "constant", 0
    cfg.lora.r = 4
    cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty, cfg.generation.backend = 64, None, backend
    cfg.grpo.num_generations, cfg.grpo.beta = 2, 0.1
    cfg.grpo.reward_funcs = ["test_tool_rollout:answer_length"]
    cfg.tools.funcs = ["test_tool_rollout:add"]
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return cfg


def _factory(tok, backend="relay"):
    from pipeline.rl.generators import make_generator

    return lambda policy: ForcedFirstCall(
        make_generator(backend, policy, tok.pad_token_id, [tok.eos_token_id], 64), tok
    )


@pytest.fixture(scope="module")
def tool_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is 2 + {i}?", "answer": str(2 + i)}) + "\n" for i in range(4)))
    return path


def test_grpo_step_trains_sampled_tokens_only_and_never_reads_inserted_logprobs(
    tmp_path, tiny_model_dir, tool_prompts, tok, monkeypatch
):
    """The same step with the log-probs at every untrained position poisoned (-1e4, which makes
    the k3 KL there overflow) gives the same loss and gradient norm."""
    from pipeline.rl import rollout as rollout_module
    from stages import grpo

    figures = {}
    for poison in (False, True):
        cfg = _grpo_cfg(tmp_path / f"p{poison}", tiny_model_dir, tool_prompts)
        stage = grpo.GRPOStage(cfg, generator_factory=_factory(tok))
        stage.validate()
        stage.build()
        assert "<tools>" in stage.train_samples[0]["text"]  # the configured tool's schema is in the prompt
        if poison:  # every log-prob the step reads comes through rollout.policy_logprobs (policy and reference)
            real, seen = rollout_module.policy_logprobs, {}
            original_rollout = stage.rollout
            monkeypatch.setattr(stage, "rollout", lambda *a, **k: seen.setdefault("r", original_rollout(*a, **k)))

            def poisoned(*args, **kwargs):
                out = real(*args, **kwargs)
                untrained = seen["r"].response_mask.to(out.logp.device) == 0
                return out._replace(logp=out.logp.masked_fill(untrained, -1e4))

            monkeypatch.setattr(rollout_module, "policy_logprobs", poisoned)
        figures[poison] = stage.train_step()
        rollout = stage.last_rollout["rollout"]
        inserted = (rollout.response_mask == 0) & (rollout.attention_mask[:, rollout.prompt_width :] == 1)
        assert inserted.any(dim=1).all(), (
            rollout.conversations
        )  # every row holds an inserted tool result, between sampled turns
        assert rollout.conversations[0][1] == {"role": "tool", "content": "5"}  # the forced call add(2, 3)
        stage.release()
    assert figures[True]["train/loss"] == figures[False]["train/loss"]
    assert figures[True]["train/grad_norm"] == figures[False]["train/grad_norm"]
    assert figures[False]["grpo/completion_length"] < inserted.shape[1]  # sampled tokens only


def test_a_tool_grpo_step_moves_each_completion_the_way_of_its_advantage(
    tmp_path, tiny_model_dir, tool_prompts, tok, monkeypatch
):
    """The sign check behind bench/RESULTS.md's falling GRPO reward (issue 29): after one tool GRPO
    step, the log-prob of the sampled tokens (inserted results excluded) of every completion whose
    reward is above its group's mean moved up against every one below it (on this random tiny
    model at lr 5e-3 all may fall together; the order between them is what GRPO owes)."""
    from pipeline.rl import grpo as algo
    from stages import grpo

    cfg = _grpo_cfg(tmp_path, tiny_model_dir, tool_prompts)
    cfg.grpo.beta = 0.0  # the policy term alone moves the weights
    stage = grpo.GRPOStage(cfg, generator_factory=_factory(tok))
    stage.validate()
    stage.build()
    real, seen = algo.grpo_update, {}

    def logp(rollout):
        scored = algo.score_completions(
            stage.inner,
            rollout,
            micro=rollout.input_ids.shape[0],
            temperature=1.0,
            autocast=stage.accelerator.autocast,
            old=True,
            reference=False,
        )
        return (scored["old"] * rollout.response_mask).sum(1)

    def update(model, optimizer, rollout, *args):
        before = logp(rollout)
        out = real(model, optimizer, rollout, *args)
        seen["moved"] = logp(rollout) - before
        return out

    monkeypatch.setattr(algo, "grpo_update", update)
    stage.train_step()
    rewards = stage.last_rollout["rewards"].view(-1, cfg.grpo.num_generations)
    stage.release()
    above = (rewards - rewards.mean(1, keepdim=True)).flatten()
    moved = seen["moved"]
    assert (above > 0).any() and (above < 0).any(), rewards
    assert moved[above > 0].min() > moved[above < 0].max(), (rewards, moved)


def test_tool_grpo_resume_reproduces_unbroken_run(tmp_path, tiny_model_dir, tool_prompts, tok, monkeypatch):
    """Stopped after step 1 and resumed: step 2's tool rollouts (ids, masks, conversations) and
    loss equal the unbroken run's, and so do the final adapters."""
    from safetensors.torch import load_file
    from stagerun import run_stage

    from stages import grpo

    def run(out, stop=None, resume=False):
        cfg = _grpo_cfg(out, tiny_model_dir, tool_prompts)
        cfg.train.max_steps, cfg.checkpoint.resume = 2, resume
        if stop is None:
            monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
        else:
            monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
        steps = {}
        run_stage(
            grpo.GRPOStage,
            cfg,
            generator_factory=_factory(tok),
            on_step=lambda st, m: steps.__setitem__(
                st.step,
                (
                    m["train/loss"],
                    st.last_rollout["rollout"].responses,
                    st.last_rollout["rollout"].response_mask.tolist(),
                    st.last_rollout["rollout"].conversations,
                ),
            ),
        )
        return steps

    unbroken = run(tmp_path / "a")
    before = run(tmp_path / "b", stop=1)
    after = run(tmp_path / "b", resume=True)
    assert sorted(before) == [1] and sorted(after) == [2]
    assert {**before, **after} == unbroken
    assert any(0 in mask for mask in unbroken[2][2][0:1])  # the rollouts hold inserted results
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("backend", ["relay", "hf"])
def test_every_backend_honours_each_rows_own_limit(tiny_model_dir, tok, backend):
    """A tool rollout's later turns give each row the budget it has left."""
    from transformers import AutoModelForCausalLM

    from pipeline.rl.generators import make_generator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = make_generator(backend, model, tok.pad_token_id, [tok.eos_token_id], 6)
    torch.manual_seed(0)
    out = generator.generate([[5, 6, 7], [8, 9]], max_new_tokens=[2, 5])
    assert len(out[0]) <= 2 and len(out[1]) <= 5 and max(len(o) for o in out) > 2
    with pytest.raises(TypeError):  # keyword only: a list of limits never lands on another option
        generator.generate([[5, 6, 7], [8, 9]], [2, 5])


# ------------------------------------------------------------------------------------------
# An engine that reports its log-probs (vLLM): budgets per turn, log-probs per sampled token
# ------------------------------------------------------------------------------------------


class FakeVLLM:
    """A vLLM server as `VLLMGenerator` talks to it (`post`, `opts.max_model_len`): it records every
    request and answers a completion with turn k's ids of `turns` (k: the assistant openers in the
    prompt), cut to the request's max_tokens, each with a log-prob that names it: -(k + 1) - i / 100
    for its i-th token."""

    def __init__(self, tok, turns, max_model_len):
        from types import SimpleNamespace

        self.tok, self.opts, self.proc = tok, SimpleNamespace(max_model_len=max_model_len), None
        self.turns = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in turns]
        self.asked: list[dict] = []
        self.paths: list[str] = []

    def post(self, path, body):
        self.paths.append(path)
        if path != "/v1/completions":
            return {}
        self.asked.append(body)
        k = self.tok.decode(body["prompt"]).count("<|im_start|>assistant") - 1
        ids = self.turns[min(k, len(self.turns) - 1)][: body["max_tokens"]]
        values = [-(k + 1) - i / 100 for i in range(len(ids))]
        return {
            "choices": [
                {"token_ids": ids, "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": values}}
            ]
        }


def _fake_policy():
    from types import SimpleNamespace

    return SimpleNamespace(
        peft_config={"default": SimpleNamespace(r=4)}, save_pretrained=lambda path, safe_serialization: None
    )


def test_a_tool_rollout_on_vllm_sends_each_turns_budget_and_keeps_the_engines_logprobs(tok, tmp_path):
    """Two rows of call, result, answer on `VLLMGenerator` (a fake server): every request asks for
    the row's remaining budget, at most the generator's and the room its context leaves under the
    server's max_model_len, at the generator's temperature (a number: the budgets are not it); the
    policy is synced once for the rollout's turns; the engine's log-probs of the sampled tokens of
    every turn are kept at their positions and the inserted tokens get NaN."""
    from pipeline.modeling.vllm_server import VLLMError
    from pipeline.rl.vllm_generator import VLLMGenerator

    t, template = _template(tok, native=False)
    env, tools = _env(t, template, max_new_tokens=80)
    sample = _sample(t, template, [Turn("user", "What is 2 + 3?")], [tool.schema for tool in tools.values()])
    P = len(sample["prompt_ids"])
    call, answer = "I will add.\n" + CALL_LAYOUT, "The sum of two and three is five, as the tool says."
    first = len(t(call, add_special_tokens=False)["input_ids"]) + 1
    probe = tool_rollout(Scripted(t, [call, answer]), [sample], env)  # where the second turn starts
    used = len(probe.responses[0]) - (
        len(t(answer, add_special_tokens=False)["input_ids"]) + 1
    )  # the call and its result
    room = 6
    for context, second in (
        (1024, env.max_new_tokens - used),
        (P + used + room, room),
    ):  # the row's budget binds, then the room
        server = FakeVLLM(t, [call, answer], max_model_len=context)
        gen = VLLMGenerator(
            _fake_policy(),
            "base",
            tmp_path,
            t.pad_token_id,
            [t.eos_token_id],
            max_new_tokens=60,
            temperature=0.7,
            server=server,
        )
        torch.manual_seed(0)
        rollout = tool_rollout(gen, [sample], env, copies=2)
        assert [b["temperature"] for b in server.asked] == [0.7] * 4
        assert [(len(b["prompt"]) - P, b["max_tokens"]) for b in server.asked] == [(0, 60)] * 2 + [(used, second)] * 2
        assert server.paths.count("/v1/load_lora_adapter") == 1  # one sync for both turns
    assert env.max_new_tokens - used > room and first < 60
    for row in range(2):  # the last run: its second turn cut at the room left
        n = len(rollout.responses[row])
        mask = rollout.response_mask[row, :n].bool()
        engine = rollout.engine_logp[row]
        assert (
            n == used + room and mask[:first].all() and not mask[first:used].any() and mask[used:].all()
        )  # a gapped mask
        assert engine[:first].tolist() == pytest.approx([-1 - i / 100 for i in range(first)])
        assert engine[used:n].tolist() == pytest.approx([-2 - i / 100 for i in range(room)])
        assert engine[first:used].isnan().all() and engine[n:].isnan().all()
    assert rollout.finished.tolist() == [False, False]
    with pytest.raises(VLLMError, match="leaves no room for a response under the vLLM server's max_model_len"):
        gen.generate([[5] * server.opts.max_model_len], max_new_tokens=[4])  # refused in one line, not a 400 from vLLM


def test_refill_keeps_a_plain_generators_logprobs_and_none_without_them(tok):
    """A generator without a session of its own (`Refill`) that reports `last_logprobs`: kept per
    sampled token, NaN on inserted ones; one that reports none: no engine log-probs at all."""

    class Reporting(Scripted):
        def generate(self, prompts, max_new_tokens=None):
            out = super().generate(prompts, max_new_tokens=max_new_tokens)
            self.last_logprobs = [[-0.5] * (len(ids) + 3) for ids in out]  # more than the ids: an engine's tail is cut
            return out

    t, template = _template(tok, native=False)
    env, tools = _env(t, template)
    sample = _sample(t, template, [Turn("user", "What is 2 + 3?")], [tool.schema for tool in tools.values()])
    turns = ["I will add.\n" + CALL_LAYOUT, "5"]
    rollout = tool_rollout(Reporting(t, turns), [sample], env)
    mask = rollout.response_mask[0].bool()
    assert (~mask[: len(rollout.responses[0])]).any()
    assert (rollout.engine_logp[0][mask] == -0.5).all() and rollout.engine_logp[0][~mask].isnan().all()
    assert tool_rollout(Scripted(t, turns), [sample], env).engine_logp is None


class ReportedAs:
    """`ForcedFirstCall` on the stage's own sampler, reporting a log-prob of -1 for every token it
    returns: a known mismatch with the trainer's (an engine that samples elsewhere, as vLLM)."""

    def __init__(self, inner):
        self.inner = inner
        self.last_logprobs = None

    def generate(self, prompts, max_new_tokens=None):
        out = self.inner.generate(prompts, max_new_tokens=max_new_tokens)
        self.last_logprobs = [[-1.0] * len(ids) for ids in out]
        return out


def check_corrected(figures, rollout, old, weight, cap):
    """A tool step on `ReportedAs`: the engine's log-probs (-1) on the sampled tokens, NaN on the
    inserted ones; rollout/logprob_diff_mean/_max over the sampled tokens only; the tis weight
    exp(trainer - engine) capped on the sampled tokens, 1 on the inserted ones and padding."""
    mask = rollout.response_mask.bool()
    inside = rollout.attention_mask[:, rollout.prompt_width :].bool()
    assert (inside & ~mask).any(1).all()  # every row holds an inserted result
    assert (rollout.engine_logp[mask] == -1.0).all() and rollout.engine_logp[inside & ~mask].isnan().all()
    delta = (old - rollout.engine_logp)[mask]
    assert figures["rollout/logprob_diff_mean"] == pytest.approx(float(delta.abs().mean()), rel=1e-5)
    assert figures["rollout/logprob_diff_max"] == pytest.approx(float(delta.abs().max()), rel=1e-5)
    want = torch.where(mask, (old - rollout.engine_logp).exp().clamp(max=cap), torch.ones_like(old))
    torch.testing.assert_close(weight, want, rtol=0, atol=1e-6)
    assert (weight[mask] != 1).any()  # the correction does weigh the sampled tokens


def test_a_tool_grpo_step_logs_and_corrects_the_engine_mismatch(
    tmp_path, tiny_model_dir, tool_prompts, tok, monkeypatch
):
    """GRPO with tools on an engine that reports its log-probs corrects them as for single answers
    (`check_corrected`; PPO's: test_ppo_step_with_tools_masks_inserted_tokens_from_loss_kl_and_values)."""
    from pipeline.rl import grpo as algo
    from stages import grpo

    cfg = _grpo_cfg(tmp_path, tiny_model_dir, tool_prompts)
    factory = _factory(tok)
    stage = grpo.GRPOStage(cfg, generator_factory=lambda policy: ReportedAs(factory(policy)))
    stage.validate()
    stage.build()
    # validation refuses tis on the relay backend (it reports no log-probs); this sampler does
    cfg.generation.correction, cfg.generation.correction_cap = "tis", 2.0
    seen, real = {}, algo.grpo_update
    monkeypatch.setattr(algo, "grpo_update", lambda *a, **k: real(*a, **k) if seen.setdefault("scored", a[4]) else None)
    figures = stage.train_step()
    check_corrected(figures, stage.last_rollout["rollout"], seen["scored"]["old"], seen["scored"]["is_weight"], 2.0)
    stage.release()


# ------------------------------------------------------------------------------------------
# PPO with tools
# ------------------------------------------------------------------------------------------


def test_gae_over_turns_skips_inserted_tokens():
    """Without gaps it is rl.gae; with an inserted block it is rl.gae of the sampled tokens alone
    (the value after a call's last token is the next turn's first), 0 on inserted positions."""
    from pipeline.algorithms import rl
    from pipeline.algorithms.rl import gae_over_turns

    g = torch.Generator().manual_seed(0)
    rewards, values = (
        torch.randn(2, 7, generator=g, dtype=torch.float64),
        torch.randn(2, 7, generator=g, dtype=torch.float64),
    )
    plain = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    for got, want in zip(gae_over_turns(rewards, values, plain, 0.9, 0.8), rl.gae(rewards, values, plain, 0.9, 0.8)):
        assert torch.equal(got, want)
    gapped = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 1]])
    adv, ret = gae_over_turns(rewards, values, gapped, 0.9, 0.8)
    for row in range(2):
        keep = gapped[row].bool()
        a, r = rl.gae(rewards[row, keep][None], values[row, keep][None], torch.ones(1, int(keep.sum())), 0.9, 0.8)
        assert torch.allclose(adv[row, keep], a[0], atol=1e-12) and torch.allclose(ret[row, keep], r[0], atol=1e-12)
        assert (adv[row, ~keep] == 0).all() and (ret[row, ~keep] == 0).all()
    assert not torch.allclose(adv, rl.gae(rewards, values, gapped, 0.9, 0.8)[0])  # plain GAE would end at every call


def test_ppo_step_with_tools_masks_inserted_tokens_from_loss_kl_and_values(
    tmp_path, tiny_model_dir, tiny_reward_dir, tool_prompts, tok
):
    from stages import ppo

    cfg = ppo.PPOConfig(output_dir=str(tmp_path / "ppo"))
    cfg.model.path, cfg.reward_model.path = str(tiny_model_dir), str(tiny_reward_dir)
    cfg.data.train, cfg.data.eval = [str(tool_prompts)], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.learning_rate = 0, 2, 1e-2
    cfg.train.lr_schedule, cfg.train.warmup = "constant", 0
    cfg.lora.r, cfg.generation.max_new_tokens = 4, 64
    cfg.tools.funcs = ["test_tool_rollout:add"]
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    factory = _factory(tok)  # an engine that reports its log-probs: the mismatch is corrected as for single answers
    stage = ppo.PPOStage(cfg, generator_factory=lambda policy: ReportedAs(factory(policy)))
    stage.validate()
    stage.build()
    cfg.generation.correction, cfg.generation.correction_cap = (
        "tis",
        2.0,
    )  # refused on relay at validation; this sampler reports
    figures = stage.train_step()
    exp = stage.last_experience
    check_corrected(figures, exp.rollout, exp.old_logprobs, exp.is_weight, 2.0)
    mask = exp.rollout.response_mask
    inserted = (mask == 0) & (exp.rollout.attention_mask[:, exp.rollout.prompt_width :] == 1)
    assert inserted.any(1).all() and all(torch.isfinite(torch.tensor(v)) for v in figures.values())
    for name in ("advantages", "returns", "values", "kl", "old_logprobs", "ref_logprobs"):
        assert (getattr(exp, name)[mask == 0] == 0).all(), name
    first_turn_end = [int(row.nonzero()[0]) - 1 for row in inserted.int()]  # the call's end-of-turn token
    assert all(exp.advantages[r, t] != 0 for r, t in enumerate(first_turn_end))  # its advantage looks past the results
    stage.release()


def test_sample_tools_have_schemas_and_errors_reach_the_model():
    tools = load_tools(ToolsConfig(funcs=["data_formats.sample_world:kelvra_lookup", "data_formats.sample_world:add"]))
    assert tools["kelvra_lookup"].schema["parameters"]["required"] == ["island", "attribute"]
    assert run_calls(
        [
            {"name": "kelvra_lookup", "arguments": {"island": "oru", "attribute": "capital"}},
            {"name": "kelvra_lookup", "arguments": {"island": "Atlantis", "attribute": "capital"}},
            {"name": "add", "arguments": {"a": 123456789123, "b": 987654321987}},
        ],
        tools,
        5.0,
    ) == [
        "Tessel",
        "error: 'kelvra_lookup' raised ValueError: no island named 'Atlantis'; the islands are "
        + ", ".join(rw.KELVRA_FACTS),
        "1111111111110",
    ]


# ------------------------------------------------------------------------------------------
# The KV cache kept across turns (relay backend)
# ------------------------------------------------------------------------------------------


def _eos_prone(tiny_model_dir, tok):
    """The tiny model with a bias on its head that makes EOS likely (about 1 in 6 per token), so
    turns end at different lengths; the same model for every path compared."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()[tok.eos_token_id] = 9.0
    model.lm_head = head
    return model.eval()


class FreshTurns:
    """The path before the kept cache: every turn a fresh `decode.generate` of the whole
    conversations (the prompt and everything since prefilled again); records each row's log-probs."""

    def __init__(self, model, tok, rows):
        self.model, self.tok, self.logprobs = model, tok, [[] for _ in range(rows)]

    def session(self, rows):
        return self

    def generate(self, rows, contexts, limits):
        from pipeline.modeling.decode import generate

        out = generate(
            self.model,
            contexts,
            max_new_tokens=limits,
            eos_ids=[self.tok.eos_token_id],
            pad_id=self.tok.pad_token_id,
            temperature=1.0,
            logprobs=True,
            keep_packed=False,
        )
        for row, lp in zip(rows, out.logprobs):
            self.logprobs[row] += lp
        return out.tokens


def _every_turn_calls(monkeypatch):
    """Ended turns read as a call to add(2, 3) (a random model writes none), except every fourth
    turn read, which is an answer: rows end at different turns."""
    import itertools

    from data_formats.tools import ParsedAnswer
    from pipeline.rl import tool_rollout as module

    read, call = itertools.count(), [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    monkeypatch.setattr(module, "parse_answer", lambda text: ParsedAnswer("", call if next(read) % 4 != 3 else [], []))


def test_kept_cache_rollout_equals_the_refilled_turns_and_hf_still_works(tiny_model_dir, tok, monkeypatch):
    """A 4-row tool rollout whose rows end at different turns (max_turns 3) and budgets: the relay
    backend's session (pipeline/modeling/decode_session.py: each row's KV cache kept, only the
    inserted ids prefilled) samples the same ids, masks and conversations as fresh calls on the
    whole conversations, with the same log-probs (1e-6); the hf backend (no session: `Refill`,
    transformers' `generate` on the whole conversation each turn) still runs the turns, and draws
    the same ids."""
    from pipeline.modeling.decode_session import DecodeSession
    from pipeline.rl.generators import RelayGenerator, make_generator

    t, template = _template(tok, native=False)
    env, tools = _env(t, template, max_new_tokens=64, max_turns=3)
    sample = _sample(t, template, [Turn("user", "What is 2 + 3?")], [tool.schema for tool in tools.values()])
    model = _eos_prone(tiny_model_dir, t)
    kept_sessions = []

    class Logged(RelayGenerator):
        def session(self, rows):
            session = super().session(rows)
            session.logprobs = [[] for _ in range(rows)]
            kept_sessions.append(session)
            return session

    runs = {}
    fresh = FreshTurns(model, t, 4)
    for name, generator in (
        ("kept", Logged(model, t.pad_token_id, [t.eos_token_id], 64)),
        ("fresh", fresh),
        ("hf", make_generator("hf", model, t.pad_token_id, [t.eos_token_id], 64)),
    ):
        _every_turn_calls(monkeypatch)
        torch.manual_seed(3)
        runs[name] = tool_rollout(generator, [sample, sample], env, copies=2)
    kept, ref = runs["kept"], runs["fresh"]
    assert isinstance(kept_sessions[0], DecodeSession) and len(kept_sessions) == 1
    assert kept.responses == ref.responses and kept.conversations == ref.conversations
    assert torch.equal(kept.response_mask, ref.response_mask) and torch.equal(kept.finished, ref.finished)
    for a, b in zip(kept_sessions[0].logprobs, fresh.logprobs):
        assert len(a) == len(b) > 0
        # the same fp32 math in another summation order (kept cache vs a fresh prefill): a few ulps,
        # which at log-probs of magnitude ~10 can exceed an absolute 1e-6 on some CPUs
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=1e-6)
    turns = [sum(m["role"] == "assistant" for m in conv) for conv in kept.conversations]
    # transformers' generate, fresh on the whole conversation each turn, draws the same ids too
    assert runs["hf"].responses == kept.responses and runs["hf"].conversations == kept.conversations
    assert max(turns) == 3 and min(turns) == 1  # rows ended at different turns: idle rows in the later calls
    for rollout in (kept, runs["hf"]):
        for row, conv in enumerate(rollout.conversations):
            inserted = (rollout.response_mask[row] == 0)[: len(rollout.responses[row])]
            assert bool(inserted.any()) == any(m["role"] == "tool" for m in conv)
    assert any(m["role"] == "tool" for conv in runs["hf"].conversations for m in conv)


def test_a_call_cut_by_the_token_budget_is_no_final_answer(tok):
    """A turn that runs out of tokens inside a call ends the rollout with the call's opener in its
    content (nothing to run, no result): the reward functions and the judge read no final answer
    there (""), not the half-written markup as if it were the answer."""
    t, template = _template(tok, native=False)
    env, _ = _env(t, template)
    sample = _sample(t, template, [Turn("user", "2 + 3?")], [{"name": "add"}])

    class Cut:  # every turn ends without EOS, inside the call
        def generate(self, prompts, max_new_tokens=None):
            return [t('Answer: 5\n<tool_call>{"name": "add", "argu', add_special_tokens=False)["input_ids"]] * len(
                prompts
            )

    rollout = tool_rollout(Cut(), [sample], env)
    (conversation,) = rollout.conversations
    assert conversation[-1]["role"] == "assistant" and "<tool_call>" in conversation[-1]["content"]
    assert rw.final_answer(conversation) == "" and rw.final_answer_match([], [conversation], answer=["5"]) == [0.0]
    assert rw.final_answer([{"role": "assistant", "content": "It is 5."}]) == "It is 5."
