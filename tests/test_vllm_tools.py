"""GRPO and PPO with tools on the vLLM generation backend (pipeline/rl/vllm_generator.py's
session, pipeline/rl/tool_rollout.py): two steps of each stage on one vLLM server, the
policy a tiny model whose turns end often, its ended turns read as calls to `add` (a random model
writes none), asserting what a tool rollout owes on an engine of its own:

- every request asks for the row's remaining budget (the response budget less the turns and
  results before it), capped by the room under the server's max_model_len, and gets no more;
- the engine's log-prob of every sampled token of every turn is recorded at its position (the
  trainer's agree within fp32 noise, which a shifted position would not), NaN on inserted tokens;
- the mismatch correction (tis, `auto` for vllm) weighs each sampled token's loss by
  exp(trainer - engine) capped, 1 on inserted ones, exactly as for a single-answer rollout;
- rollout/logprob_diff_mean/_max are logged.

The vLLM environment and its wait are tests/test_vllm.py's (`vllm_ready`, imported here); this
module starts one server of its own, on that model, shared by both stages.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_vllm import vllm_ready, vllm_untied  # noqa: F401  (fixtures: the install wait, the untied tiny model)

from pipeline.modeling.manifest import write_manifest
from pipeline.modeling.vllm_server import VLLMServer

CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
QUESTIONS = [f"What is 2 + {i}?" for i in range(4)]


@pytest.fixture(scope="module")
def caller(vllm_untied, tmp_path_factory):  # noqa: F811  (the fixture imported from test_vllm)
    """vllm_untied made to end its turns often (about 1 token in 5 is the end-of-turn token at
    T 0.8), so turns end at different lengths and rows take several turns: the residual stream's
    dimension 0 is a constant (every embedding's, no layer writes it), and the head reads EOS off it
    alone. The engine and the trainer compute the same (Llama, untied head)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_untied)
    model = AutoModelForCausalLM.from_pretrained(vllm_untied, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tok.eos_token_id] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = 1.0
    folder = tmp_path_factory.mktemp("vllm-tools") / "caller"
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    write_manifest(folder, stage="tiny-random", parent=None, config={"eos_prone": True})
    return folder


@pytest.fixture
def calls(monkeypatch):
    """Inside the stages' tool rollouts, an ended turn reads as a call to add(2, 3), except every
    third one read, which is an answer (a random model writes no call; the engine still samples
    every token). Validation's layout check reads with the real reader."""
    import itertools

    from data_formats.tools import ParsedAnswer
    from pipeline.rl import policy_stage as policy
    from pipeline.rl import tool_rollout as module

    read, real = itertools.count(), module.tool_rollout

    def reading(text):
        return ParsedAnswer("", [CALL] if next(read) % 3 != 2 else [], [])

    def rollout(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(module, "parse_answer", reading)
            return real(*args, **kwargs)

    monkeypatch.setattr(policy, "tool_rollout", rollout)


@pytest.fixture(scope="module")
def tools_server(caller, tmp_path_factory):
    """One server on `caller` with runtime LoRA (the stages' policies are LoRAs on it)."""
    from pipeline.rl.vllm_generator import engine_options

    with VLLMServer(
        str(caller), engine_options(8), log_path=tmp_path_factory.mktemp("vllm-log") / "tools.log"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-tools") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": "5"}) + "\n" for q in QUESTIONS))
    return path


def recorded(monkeypatch) -> list[tuple[list[int], int, list[int]]]:
    """Every request a `VLLMGenerator` sends from now on: (prompt ids, max_tokens, the ids it got)."""
    from pipeline.rl.vllm_generator import VLLMGenerator

    seen, real = [], VLLMGenerator.request

    def request(self, model, prompt, *args, **kwargs):
        ids, values = real(self, model, prompt, *args, **kwargs)
        seen.append((list(prompt), kwargs.get("max_tokens", self.max_new_tokens), ids))
        return ids, values

    monkeypatch.setattr(VLLMGenerator, "request", request)
    return seen


def factory(server, folder, workdir, cfg):
    """The stage's sampler on the shared `server` (as `make_generator` builds it for backend vllm)."""
    from transformers import AutoTokenizer

    from pipeline.rl.vllm_generator import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(folder)
    gen = cfg.generation
    return lambda policy: VLLMGenerator(
        policy,
        str(folder),
        workdir,
        tok.pad_token_id,
        [tok.eos_token_id],
        gen.max_new_tokens,
        gen.temperature,
        max_model_len=cfg.train.seq_length,
        server=server,
    )


def check_step(rollout, requests, figures, old, weight, cfg, max_model_len):
    """What one step of a tool rollout on vLLM owes (the module docstring)."""
    budget = cfg.generation.max_new_tokens
    mask = rollout.response_mask.bool()
    inside = rollout.attention_mask[:, rollout.prompt_width :].bool()
    inserted = inside & ~mask
    assert inserted.any(1).sum() >= 1, rollout.conversations  # ended turns were calls: results were inserted
    assert any(m["role"] == "tool" and m["content"] == "5" for conv in rollout.conversations for m in conv)
    # budgets: each request is one row's turn; its context is that row's prompt and its tokens so far
    rows = [rollout.input_ids[r][rollout.attention_mask[r].bool()].tolist() for r in range(len(rollout.responses))]
    starts = [len(row) - len(resp) for row, resp in zip(rows, rollout.responses)]
    later = 0
    for prompt, max_tokens, got in requests:
        r = next(r for r, row in enumerate(rows) if row[: len(prompt)] == prompt and len(prompt) >= starts[r])
        used = len(prompt) - starts[r]
        assert max_tokens == min(budget - used, budget, max_model_len - len(prompt)) and len(got) <= max_tokens
        later += used > 0
    assert later >= 1  # later turns were asked for what their rows had left
    # the engine's log-probs: every sampled token's, NaN on the inserted ones, at the trainer's within fp32 noise
    engine = rollout.engine_logp
    assert engine is not None and not engine[mask].isnan().any() and engine[inserted].isnan().all()
    assert figures["rollout/logprob_diff_max"] < 1e-3 and figures["rollout/logprob_diff_mean"] < 1e-4, figures
    delta = (old - engine)[mask].abs()
    assert figures["rollout/logprob_diff_max"] == pytest.approx(float(delta.max()), rel=1e-5, abs=1e-9)
    # the correction: tis (auto for vllm), on the sampled tokens only
    want = torch.where(mask, (old - engine).exp().clamp(max=cfg.generation.correction_cap), torch.ones_like(old))
    assert weight is not None
    torch.testing.assert_close(weight, want, rtol=0, atol=1e-6)


def test_grpo_with_tools_on_vllm(caller, tools_server, questions, calls, tmp_path, monkeypatch):
    from stagerun import run_stage
    from test_tool_rollout import _grpo_cfg

    from pipeline.rl import grpo as algo
    from pipeline.tools.report import read_scalars
    from stages import grpo

    cfg = _grpo_cfg(tmp_path / "out", caller, questions, backend="vllm")
    cfg.train.max_steps, cfg.train.seq_length = 2, 512
    cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.tools.max_turns = 48, 0.8, 3
    cfg.tracking.trackers = ["tensorboard"]
    assert cfg.generation.correction == "auto" and cfg.generation.correction_name == "tis"
    requests = recorded(monkeypatch)
    weights, real_loss, real_update, scored = [], algo.grpo_loss, algo.grpo_update, {}
    monkeypatch.setattr(
        algo,
        "grpo_loss",
        lambda *a, is_weight=None, **k: weights.append(is_weight) or real_loss(*a, is_weight=is_weight, **k),
    )
    monkeypatch.setattr(
        algo, "grpo_update", lambda *a, **k: scored.__setitem__(len(scored) + 1, dict(a[4])) or real_update(*a, **k)
    )
    seen = {}

    def on_step(stage, figures):
        seen[stage.step] = (figures, stage.last_rollout["rollout"], list(requests))
        requests.clear()

    stage = run_stage(
        grpo.GRPOStage, cfg, on_step=on_step, generator_factory=factory(tools_server, caller, tmp_path / "v", cfg)
    )
    assert stage.final_summary["steps"] == 2 and sorted(seen) == [1, 2]
    for step, (figures, rollout, asked) in seen.items():
        print(
            f"GRPO step {step}: {len(asked)} requests, "
            f"max_tokens {sorted({m for _, m, _ in asked})}, logprob diff mean "
            f"{figures['rollout/logprob_diff_mean']:.2e} max {figures['rollout/logprob_diff_max']:.2e}"
        )
        check_step(
            rollout,
            asked,
            figures,
            scored[step]["old"],
            scored[step].get("is_weight"),
            cfg,
            tools_server.opts.max_model_len,
        )
    assert weights and all(w is not None for w in weights)  # every policy-loss call was corrected
    scalars = read_scalars(tmp_path / "out")
    assert [s for s, _ in scalars["rollout/logprob_diff_mean"]] == [1, 2] and [
        s for s, _ in scalars["rollout/logprob_diff_max"]
    ] == [1, 2]


def test_ppo_with_tools_on_vllm(caller, tiny_reward_dir, tools_server, questions, calls, tmp_path, monkeypatch):
    from stagerun import run_stage
    from test_ppo import make_cfg

    from pipeline.rl import ppo as algo
    from stages import ppo

    cfg = make_cfg(
        tmp_path / "out",
        caller,
        tiny_reward_dir,
        questions,
        max_steps=2,
        batch_size=2,
        learning_rate=1e-2,
        seq_length=512,
    )
    cfg.generation.backend, cfg.generation.max_new_tokens, cfg.generation.temperature = "vllm", 48, 0.8
    cfg.tools.funcs, cfg.tools.max_turns = ["test_tool_rollout:add"], 3
    assert cfg.generation.correction_name == "tis"
    requests = recorded(monkeypatch)
    weights, real_loss = [], algo.policy_loss
    monkeypatch.setattr(
        algo, "policy_loss", lambda *a, weight=None, **k: weights.append(weight) or real_loss(*a, weight=weight, **k)
    )
    seen = {}

    def on_step(stage, figures):
        seen[stage.step] = (figures, stage.last_experience, list(requests))
        requests.clear()

    stage = run_stage(
        ppo.PPOStage, cfg, on_step=on_step, generator_factory=factory(tools_server, caller, tmp_path / "v", cfg)
    )
    assert stage.final_summary["steps"] == 2 and sorted(seen) == [1, 2]
    for step, (figures, exp, asked) in seen.items():
        print(
            f"PPO step {step}: {len(asked)} requests, max_tokens {sorted({m for _, m, _ in asked})}, logprob diff mean "
            f"{figures['rollout/logprob_diff_mean']:.2e} max {figures['rollout/logprob_diff_max']:.2e}"
        )
        check_step(exp.rollout, asked, figures, exp.old_logprobs, exp.is_weight, cfg, tools_server.opts.max_model_len)
        assert (exp.advantages[exp.rollout.response_mask == 0] == 0).all()
    assert weights and all(w is not None for w in weights)
    assert stage._generator is None and tools_server.proc.poll() is None  # released, the shared server left running
