"""RM stage (stages/reward.py, pipeline/modeling/scoring.py): pairwise loss, last-token scores under both
paddings, the trained head surviving the merge, stored reward statistics, resume; and the
embedded end to end RM -> PPO -> merged policy that generates."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from stagerun import recording, run_stage
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from data_formats.collate import PairCollator, left_pad
from pipeline.algorithms import pairwise
from pipeline.modeling.manifest import read_manifest
from pipeline.modeling.scoring import reward_readout_index, sequence_scores, token_scores
from stages import reward as rm

PAIRS = [
    ("What colour is the sky?", "The sky is blue.", "I do not know."),
    ("How many legs has a cat?", "A cat has four legs.", "Cats are hard to count."),
    ("Name a prime number.", "Seven is a prime number.", "No idea, sorry."),
    ("What is 2 + 2?", "2 + 2 is 4.", "Maths is not my thing."),
    ("Where is Paris?", "Paris is in France.", "Somewhere, I guess."),
    ("What do bees make?", "Bees make honey.", "Ask a beekeeper."),
]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_data")
    rows = [{"question": q, "response_chosen": c, "response_rejected": r} for q, c, r in PAIRS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return root / "train.jsonl", root / "valid.jsonl"


def make_cfg(out, base, files, **train) -> rm.RMConfig:
    cfg = rm.RMConfig(output_dir=str(out))
    cfg.model.path = str(base)
    cfg.data.train, cfg.data.eval = [str(files[0])], [str(files[1])]
    cfg.train.batch_size, cfg.train.max_steps, cfg.train.eval_steps = 2, 3, 2
    cfg.train.learning_rate, cfg.train.lr_schedule, cfg.train.warmup = 5e-3, "constant", 0
    cfg.train.seq_length = 128
    cfg.lora.r = 4
    cfg.checkpoint.resume = False
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_pairwise_loss_golden_values():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.5])
    margin = torch.tensor([0.5, 0.0])
    # diffs 0.5 and -0.5: log(1 + e^-0.5) = 0.474077, log(1 + e^0.5) = 0.974077
    assert pairwise.pairwise_loss(chosen, rejected, margin).item() == pytest.approx(0.7240770, abs=1e-6)
    # centring adds 0.01 * mean(1^2, 0.5^2) = 0.00625
    assert pairwise.pairwise_loss(chosen, rejected, margin, 0.01).item() == pytest.approx(0.7303270, abs=1e-6)
    assert pairwise.pairwise_loss(chosen, rejected).item() == pytest.approx(
        (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2, abs=1e-6
    )


def test_pair_collator_layout():
    batch = PairCollator(0)(
        [
            {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [8], "margin": 1.5},
            {"chosen_input_ids": [9], "rejected_input_ids": [3, 4], "margin": None},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0], [8, 0, 0], [3, 4, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]]
    assert batch["margin"].tolist() == [1.5, 0.0]


def test_scores_equal_under_left_and_right_padding(tiny_reward_dir):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir).eval()
    seqs = [[11, 12, 13, 14, 15, 16], [21, 22], [31, 32, 33, 34]]
    left_ids, left_mask = left_pad(seqs, 0)
    right_ids = torch.zeros_like(left_ids)
    right_mask = torch.zeros_like(left_mask)
    for row, seq in enumerate(seqs):
        right_ids[row, : len(seq)] = torch.tensor(seq)
        right_mask[row, : len(seq)] = 1
    with torch.no_grad():
        left = sequence_scores(model, left_ids, left_mask)
        right = sequence_scores(model, right_ids, right_mask)
        alone = torch.cat(
            [sequence_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)) for s in seqs]
        )
        per_token = token_scores(model, left_ids, left_mask)
    torch.testing.assert_close(left, right, rtol=0, atol=1e-5)
    torch.testing.assert_close(left, alone, rtol=0, atol=1e-5)
    # PPO's per-token path reads the same score at the last token
    torch.testing.assert_close(per_token[torch.arange(3), reward_readout_index(left_mask)], left, rtol=0, atol=1e-5)
    assert len(set(left.tolist())) == 3  # the three sequences really score differently


def test_rm_stage_head_survives_merge_and_stats_recorded(tmp_path, tiny_model_dir, pair_files):
    from accelerate.utils import set_seed

    from pipeline.modeling.models import load_model

    cfg = make_cfg(tmp_path / "out", tiny_model_dir, pair_files)
    set_seed(cfg.train.seed)  # the stage seeds the same way before creating the fresh head
    initial_head = load_model(cfg.model, None, kind="reward").score.weight.detach().clone()
    run_stage(rm.RMStage, cfg)
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "train_loss_first",
        "train_loss_last",
        "eval_accuracy",
        "eval_margin",
        "eval_loss_last",
        "steps",
        "wall_seconds",
    ):
        assert summary[key] is not None, key
    assert summary["steps"] == 3
    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged").eval()
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    trained = [v for k, v in adapter.items() if "score" in k]
    assert len(trained) == 1
    assert torch.equal(merged.score.weight, trained[0])
    assert not torch.equal(merged.score.weight, initial_head)
    # reward_stats: the merged model's own scores over the training responses
    stats = read_manifest(out / "merged")["reward_stats"]
    assert json.loads((out / "merged" / "config.json").read_text())[pairwise.REWARD_STATS_KEY] == stats
    prepared = rm.RMStage(cfg)
    prepared.validate()
    seqs = [p["chosen_input_ids"] for p in prepared.train_samples] + [
        p["rejected_input_ids"] for p in prepared.train_samples
    ]
    ids, mask = left_pad(seqs, prepared.tokenizer.pad_token_id)
    with torch.no_grad():
        scores = sequence_scores(merged, ids, mask).double()
    assert stats["n"] == 2 * len(PAIRS)
    assert stats["mean"] == pytest.approx(scores.mean().item(), abs=1e-4)
    assert stats["std"] == pytest.approx(scores.std(unbiased=False).item(), abs=1e-4)


def test_rm_resume_equals_continuous(tmp_path, tiny_reward_dir, pair_files, monkeypatch):
    cfg = make_cfg(tmp_path / "a", tiny_reward_dir, pair_files, eval_steps=0)
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
    continuous = run_stage(recording(rm.RMStage), cfg)
    cfg_b = make_cfg(tmp_path / "b", tiny_reward_dir, pair_files, eval_steps=0)
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    stopped = run_stage(recording(rm.RMStage), cfg_b)
    assert stopped.step == 2 and not (tmp_path / "b" / "merged").exists()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    cfg_b.checkpoint.resume = True
    resumed = run_stage(recording(rm.RMStage), cfg_b)
    assert resumed.batch_ids == continuous.batch_ids[2:]
    assert [s["train/loss"] for s in resumed.history.steps] == [s["train/loss"] for s in continuous.history.steps]
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_end_to_end_embedded_rm_then_ppo(tmp_path, embedded_path, pair_files):
    """Embedded model as 'SFT-merged' -> 2-step RM -> 2 PPO steps -> merged policy generates."""
    from stages import ppo

    rm_cfg = make_cfg(tmp_path / "rm", embedded_path, pair_files, max_steps=2, eval_steps=0)
    # a short system turn replaces SmolLM2's ~30-token default one: shorter sequences, same code paths
    rm_cfg.data.eval, rm_cfg.reward.stats_max_pairs, rm_cfg.data.system_prompt = [], 2, "Be brief."
    run_stage(rm.RMStage, rm_cfg)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _, _ in PAIRS[:4]))
    cfg = ppo.PPOConfig(output_dir=str(tmp_path / "ppo"))
    cfg.model.path, cfg.reward_model.path = str(embedded_path), str(tmp_path / "rm" / "merged")
    cfg.data.train, cfg.data.eval, cfg.data.system_prompt = [str(prompts)], [], "Be brief."
    cfg.train.max_steps, cfg.train.batch_size, cfg.train.eval_steps = 2, 2, 0
    cfg.generation.max_new_tokens = 8
    cfg.ppo.reward_norm, cfg.ppo.epochs = "stored", 1
    cfg.lora.r = 4
    cfg.checkpoint.resume = False
    summary = run_stage(ppo.PPOStage, cfg).final_summary
    for key in ("reward_first", "reward_last", "kl_last", "steps", "wall_seconds"):
        assert summary[key] is not None, key
    assert summary["eval_reward_first"] is None and summary["steps"] == 2  # evaluation is off here
    merged = tmp_path / "ppo" / "merged"
    assert read_manifest(merged)["stage"] == "ppo"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
