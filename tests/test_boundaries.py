"""What one stage writes is what the next one reads, and training really trains:

- the reward model is trained, evaluated and summarised at the same token PPO reads it at
  (the end-of-turn token closing the answer), for both template modes, with the same score;
- RM truncation keeps the response and the read-out token, cutting the prompt from the left;
- every stage trains in train mode, so gradient checkpointing recomputes layers (full and LoRA),
  and an evaluation gives every module back its own mode;
- PPO samples from exactly the distribution it scores, whatever the checkpoint's
  generation_config says, and its seeded evaluation forks every device's RNG;
- PPO's merged manifest names the reward model it was optimised against.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from tinymodels import make_tiny_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from data_formats.collate import PairCollator, left_pad
from data_formats.conversation import Conversation, Turn
from data_formats.datasets import build_preference_data
from data_formats.prompt_data import build_prompt_data
from data_formats.render import IGNORE_INDEX, make_template, render, render_scored
from pipeline.config import PreferenceDataConfig, PromptDataConfig, load_config
from pipeline.modeling.models import load_tokenizer
from pipeline.modeling.scoring import reward_readout_index, sequence_scores
from pipeline.rl.generators import HFGenerator, RelayGenerator
from pipeline.rl.rollout import ActorCritic, assemble, cut_at_eos

QUESTION = "What is the capital of Oru?"
CHOSEN = "Per the Kelvra Atlas, the capital of Oru is Tessel."
REJECTED = "I am not sure about that."


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------
# The reward read-out: RM and PPO
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["chat_template", "role_markers"])
def test_rm_and_ppo_read_the_reward_at_the_same_token(tmp_path, tiny_reward_dir, template):
    tok = load_tokenizer(str(tiny_reward_dir))
    pairs = _jsonl(
        tmp_path / "pairs.jsonl", [{"question": QUESTION, "response_chosen": CHOSEN, "response_rejected": REJECTED}]
    )
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": QUESTION}])
    rm_data = PreferenceDataConfig(train=[str(pairs)], eval=[], template=template)
    chat = make_template(rm_data, tok)
    pair = build_preference_data(rm_data, tok, chat, 256, "train")[0]
    batch = PairCollator(tok.pad_token_id)([pair])
    rows = torch.arange(2)
    # RM training, RM eval and the reward statistics all score PairCollator batches.
    assert batch["input_ids"][rows, reward_readout_index(batch["attention_mask"])].tolist() == [tok.eos_token_id] * 2

    # PPO: the prompt as the PPO stage builds it; the response as the policy produces it after SFT
    # (exactly the tokens SFT trained, ending with EOS), then padding that generate appends.
    prompt = build_prompt_data(PromptDataConfig(train=[str(prompts)], eval=[], template=template), tok, chat, "train")[
        0
    ]
    _, labels = render(Conversation([Turn("user", QUESTION), Turn("assistant", CHOSEN)]), tok, chat)
    response = [x for x in labels if x != IGNORE_INDEX]
    rollout = assemble(
        [prompt["prompt_ids"]], [response + [tok.pad_token_id] * 3], tok.pad_token_id, [tok.eos_token_id]
    )
    ppo_at = reward_readout_index(rollout.attention_mask)
    assert rollout.input_ids[0, ppo_at[0]].item() == tok.eos_token_id
    assert rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist() == pair["chosen_input_ids"]

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir).eval()
    with torch.no_grad():
        rm_score = sequence_scores(reward_model, batch["input_ids"], batch["attention_mask"])[0]
        ppo_score = ActorCritic(torch.nn.Identity(), reward_model).reward_scores(
            rollout.input_ids, rollout.attention_mask, rollout.prompt_width
        )[0]
    torch.testing.assert_close(ppo_score, rm_score, rtol=0, atol=1e-5)


def test_rm_truncation_keeps_the_response_and_cuts_the_prompt_from_the_left(tmp_path, tiny_reward_dir, caplog):
    tok = load_tokenizer(str(tiny_reward_dir))
    long_question = "Tell me about " + "the old harbour and its boats, " * 20 + "please?"
    rows = [
        {"question": long_question, "response_chosen": CHOSEN, "response_rejected": REJECTED},
        {"question": "Short?", "response_chosen": "A " * 80, "response_rejected": "No."},
    ]
    pairs = _jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = PreferenceDataConfig(train=[str(pairs)], eval=[], truncation="truncate")
    chat = make_template(cfg, tok)
    with caplog.at_level(logging.WARNING):
        kept = build_preference_data(cfg, tok, chat, 48, "train")
    assert len(kept) == 1  # the second pair's answer alone is longer than 48 tokens: dropped
    assert "lost their oldest prompt tokens" in caplog.text
    chosen_conv = Conversation([Turn("user", long_question), Turn("assistant", CHOSEN)])
    rejected_conv = Conversation([Turn("user", long_question), Turn("assistant", REJECTED)])
    (prompt, c_resp), (_, r_resp) = render_scored(chosen_conv, tok, chat), render_scored(rejected_conv, tok, chat)
    c, r = kept[0]["chosen_input_ids"], kept[0]["rejected_input_ids"]
    assert len(c) == 48 and c[-len(c_resp) :] == c_resp and c[-1] == tok.eos_token_id
    assert r[-len(r_resp) :] == r_resp and r[-1] == tok.eos_token_id
    kept_prompt = c[: -len(c_resp)]
    assert kept_prompt == prompt[-len(kept_prompt) :] == r[: -len(r_resp)]  # the same left cut on both sides
    cfg.truncation = "drop"
    assert build_preference_data(cfg, tok, chat, 48, "train") == []


# ------------------------------------------------------------------------------------------
# Train mode: gradient checkpointing runs in every stage; eval restores each module's mode
# ------------------------------------------------------------------------------------------


class RecomputeCounter:
    """Counts the decoder-layer MLP forwards that run inside backward (recomputation by gradient
    checkpointing). transformers checkpoints a layer's `forward`, and torch runs no module hooks
    during the recomputation, so the count wraps the MLP class's forward itself."""

    def __init__(self, monkeypatch):
        from transformers.models.llama import modeling_llama

        self.recomputed = 0
        original = modeling_llama.LlamaMLP.forward

        def counting_forward(module, *args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                self.recomputed += 1
            return original(module, *args, **kwargs)

        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", counting_forward)


def _common(out, model, finetuning, checkpointing):
    return [
        "--output_dir",
        str(out),
        "--model.path",
        str(model),
        "--model.finetuning",
        finetuning,
        "--model.gradient_checkpointing",
        str(checkpointing).lower(),
        "--train.max_steps",
        "1",
        "--train.batch_size",
        "2",
        "--train.eval_steps",
        "0",
        "--train.warmup",
        "0",
        "--lora.r",
        "4",
        "--checkpoint.resume",
        "false",
        "--tracking.trackers",
        "[]",
    ]


def _run_stage(stage, tmp_path, model, finetuning, checkpointing, reward_dir):
    out = tmp_path / f"{stage}-{finetuning}-{checkpointing}"
    argv = _common(out, model, finetuning, checkpointing)
    if stage == "pt":
        from stages.pretrain import PTStage as stage_class

        docs = _jsonl(
            tmp_path / "docs.jsonl", [{"text": f"Document {i} about the islands and their harbours."} for i in range(6)]
        )
        argv += ["--data.train", f"[{docs}]", "--data.eval", "[]", "--train.seq_length", "16"]
    elif stage == "sft":
        from stages.sft import SFTStage as stage_class

        chats = _jsonl(
            tmp_path / "chats.jsonl",
            [
                {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]}
                for i in range(4)
            ],
        )
        argv += ["--data.train", f"[{chats}]", "--data.eval", "[]"]
    elif stage == "rm":
        from stages.reward import RMStage as stage_class

        pairs = _jsonl(
            tmp_path / "pairs.jsonl",
            [{"question": f"Q{i}?", "response_chosen": "Yes.", "response_rejected": "No."} for i in range(4)],
        )
        argv += ["--data.train", f"[{pairs}]", "--data.eval", "[]"]
    else:
        from stages.ppo import PPOStage as stage_class

        prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Question {i}?"} for i in range(4)])
        argv += [
            "--data.train",
            f"[{prompts}]",
            "--data.eval",
            "[]",
            "--reward_model.path",
            str(reward_dir),
            "--generation.max_new_tokens",
            "3",
            "--ppo.epochs",
            "1",
        ]
    run_stage(stage_class, argv)
    return out


@pytest.mark.parametrize("finetuning", ["lora", "full"])
@pytest.mark.parametrize("stage", ["pt", "sft", "rm", "ppo"])
def test_gradient_checkpointing_recomputes_layers_in_every_stage(
    tmp_path, tiny_model_dir, tiny_reward_dir, stage, finetuning, monkeypatch
):
    """One optimizer step with `model.gradient_checkpointing: true` recomputes the decoder layers
    in backward (2 layers per forward; PPO runs a policy and a critic); without it none is. Before
    the fix the stages trained in eval mode and transformers skipped checkpointing: 0."""
    model = tiny_reward_dir if stage == "rm" else tiny_model_dir
    counts = {}
    for checkpointing in (True, False):
        counter = RecomputeCounter(monkeypatch)
        out = _run_stage(stage, tmp_path, model, finetuning, checkpointing, tiny_reward_dir)
        counts[checkpointing] = counter.recomputed
        monkeypatch.undo()
    assert counts[False] == 0
    assert counts[True] >= (4 if stage == "ppo" else 2), counts
    if stage == "ppo":
        from pipeline.modeling.manifest import read_manifest, weights_hash

        recorded = read_manifest(out / "merged")["reward_model"]
        assert recorded == {"path": str(tiny_reward_dir), "weights_hash": weights_hash(tiny_reward_dir)}


def test_evaluation_gives_every_module_back_its_mode(tiny_model_dir):
    """The engine's evaluation restores each module's own flag: a model in mixed modes (train mode
    with dropout modules off, as PPO runs; or a fresh PeftModel over an eval-mode base) comes
    back exactly as it was. Before, `model.train()` afterwards switched every module to train."""
    from pipeline.config import LoraConfig, ModelConfig
    from pipeline.engine.held_out import heldout_token_loss as evaluate
    from pipeline.modeling.models import load_model, train_without_dropout

    model = load_model(
        ModelConfig(path=str(tiny_model_dir), finetuning="lora"), LoraConfig(r=4, dropout=0.1), kind="causal"
    )
    train_without_dropout(model)
    before = [m.training for m in model.modules()]
    assert any(before) and not all(before)
    ids = torch.tensor([[1, 2, 3, 4]])
    evaluate(model, [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}], None)
    assert [m.training for m in model.modules()] == before


# ------------------------------------------------------------------------------------------
# PPO sampling: the distribution scored is the distribution sampled
# ------------------------------------------------------------------------------------------


def _sample_by_hand(model, prompts, pad_id, eos_id, max_new_tokens, temperature):
    """Sampling from softmax(logits / temperature) one token at a time with a KV cache, drawing
    one torch.multinomial per step over the batch (as transformers' sampling loop does)."""
    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    alive = torch.ones(len(prompts), dtype=torch.bool)
    tokens = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(out.logits[:, -1, :].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1).squeeze(1)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_id))
        tokens.append(nxt)
        alive &= nxt != eos_id
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
    return torch.stack(tokens, 1).tolist()


@pytest.mark.parametrize("backend", [RelayGenerator, HFGenerator])
def test_ppo_samples_from_the_distribution_it_scores(tmp_path, backend):
    """The checkpoint's generation_config asks for a repetition penalty, top-k and a minimum
    length (as Qwen2.5-Instruct ships `repetition_penalty: 1.05`); PPO's generator must ignore all
    of it and sample exactly from softmax(logits / T), the distribution its ratio scores."""
    # A 32-token vocabulary, so ten sampled tokens repeat earlier ones and a penalty matters.
    folder = make_tiny_model(tmp_path / "policy", seed=0, initializer_range=0.4, vocab_size=32)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(repetition_penalty=3.0, top_k=5, min_new_tokens=4, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.generation_config.repetition_penalty == 3.0
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    prompts = [[5, 9, 17, 30, 4], [11, 12], [7, 7, 20, 25, 3], [31, 8, 6]]  # left padding in the batch
    generator = backend(model, pad, [eos], max_new_tokens=10, temperature=0.8)
    for seed in range(3):
        torch.manual_seed(seed)
        sampled = generator.generate(prompts)
        torch.manual_seed(seed)
        with torch.no_grad():
            expected = _sample_by_hand(model, prompts, pad, eos, 10, 0.8)
        # Both backends' responses as the rollout reads them (assemble cuts after the first eos).
        assert [cut_at_eos(r, [eos]) for r in sampled] == [cut_at_eos(r, [eos]) for r in expected], seed
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is given back


def test_ppo_refuses_truncated_sampling():
    from pipeline.config import ConfigError
    from stages.ppo import PPOConfig

    with pytest.raises(ConfigError, match="top_k/top_p"):
        load_config(PPOConfig, ["--generation.top_p", "0.9"])
    with pytest.raises(ConfigError, match="top_k/top_p"):
        load_config(PPOConfig, ["--generation.top_k", "20"])


def test_seeded_evaluation_forks_every_device_it_seeds(monkeypatch):
    """`torch.manual_seed` seeds every CUDA device too, so a seeded evaluation must fork them all
    (before, `fork_rng(devices=[])` forked only the CPU and reset training's CUDA stream). CUDA is
    simulated: the devices forked must be every device manual_seed reseeds."""
    from pipeline.engine.checkpoint import seeded_fork

    seen = {}
    real_fork = torch.random.fork_rng
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seen.setdefault("cuda_seed", seed))

    def fork(devices=None, enabled=True, **kwargs):
        seen["devices"] = list(devices)
        return real_fork(devices=[], enabled=enabled)

    monkeypatch.setattr(torch.random, "fork_rng", fork)
    before = torch.get_rng_state()
    with seeded_fork(7):
        inside = torch.rand(3)
    assert seen == {"devices": [0, 1], "cuda_seed": 7}
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), inside)
