"""The peers' own sample files (excerpts in tests/data/peers, sources in SOURCES.md): each one
validates for the stage it is meant for and trains a step there (tiny model), or is refused in
one line that says why and what to do; every record is counted as good or as a problem."""

import json
from pathlib import Path

import pytest
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401  (autouse: fresh accelerate state, one intra-op thread)

from data_formats.sources import read_entry, summarize
from data_formats.validate import read_and_parse

PEERS = Path(__file__).resolve().parent / "data" / "peers"
M, L = "MedicalGPT", "LLaMA-Factory"
# file -> (validate kind, good records, or the start of the one refusal line's reason)
EXPECTED = {
    f"{M}/pretrain/en_article_tail500.txt": ("pt", 1),
    f"{M}/pretrain/fever.txt": ("pt", 1),
    f"{M}/pretrain/tianlongbabu.txt": ("pt", 1),
    f"{M}/rag/medical_corpus.txt": ("pt", 1),
    f"{L}/c4_demo.jsonl": ("pt", 3),
    f"{L}/wiki_demo.txt": ("pt", 1),
    f"{M}/sft/medical_sft_1K_format.jsonl": ("sft", 3),
    f"{M}/sft/sharegpt_zh_1K_format.jsonl": ("sft", 3),
    f"{M}/sft/glaive_toolcall_zh_demo.jsonl": ("sft", 4),
    f"{L}/alpaca_en_demo.json": ("sft", 3),
    f"{L}/alpaca_zh_demo.json": ("sft", 3),
    f"{L}/glaive_toolcall_en_demo.json": ("sft", 4),
    f"{L}/glaive_toolcall_zh_demo.json": ("sft", 4),
    f"{M}/reward/dpo_zh_500.jsonl": ("rm", 3),
    f"{M}/reward/toolcall_dpo_zh_demo.jsonl": ("rm", 6),
    f"{L}/dpo_en_demo.json": ("rm", 3),
    f"{L}/dpo_zh_demo.json": ("rm", 3),
    f"{L}/v1_dpo_demo.jsonl": ("rm", 3),
    f"{M}/grpo/sample.jsonl": ("prompts", 4),
    f"{L}/identity.json": ("sft", "unfilled placeholder {{name}} (LLaMA-Factory's identity.json): replace"),
    f"{L}/v1_sft_demo.jsonl": ("sft", "unfilled placeholder {{name}}"),
    f"{L}/kto_en_demo.json": ("sft", "a true/false 'label' on one answer (KTO data): train it with the KTO stage"),
    f"{L}/mllm_demo.json": ("sft", "multimodal record (field 'images'): Relay trains text-only"),
    f"{L}/mllm_audio_demo.json": ("sft", "multimodal record (field 'audios')"),
    f"{L}/mllm_video_demo.json": ("sft", "multimodal record (field 'videos')"),
    f"{L}/mllm_video_audio_demo.json": ("sft", "multimodal record (field 'audios')"),
    f"{L}/v1_multimodal_demo.jsonl": ("sft", "multimodal record (a 'image_url' content part)"),
    f"{L}/reason_tool_use_demo_50.jsonl": ("sft", "a 'reasoning' content part (LLaMA-Factory v1 reasoning data)"),
    f"{L}/dataset_info.json": ("sft", "this is LLaMA-Factory's dataset registry (dataset_info.json)"),
}
EXPECTED.update(
    {  # issue 32: public formats beyond the two peers (tests/test_formats_public.py checks ids and masks)
        "hh-rlhf/harmless-base/test.jsonl": ("rm", 5),
        "Firefly/dummy_dpo.jsonl": ("rm", 2),
        "together-python/test_preference_openai.jsonl": ("rm", 2),
        "Firefly/dummy_data.jsonl": ("sft", 2),
        "openai-cookbook/toy_chat_fine_tuning.jsonl": ("sft", 3),
        "ApiLogicServer-src/logic_trainer_multi_turn.jsonl": ("sft", 1),
    }
)


def test_every_excerpt_is_listed_and_has_its_source():
    files = {str(p.relative_to(PEERS)) for p in PEERS.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    assert files == set(EXPECTED)
    sources = (PEERS / "SOURCES.md").read_text(encoding="utf-8")
    assert all(f"`{name.split('/', 1)[1]}`" in sources for name in EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_peer_file_validates_or_is_refused_in_one_line(name):
    kind, outcome = EXPECTED[name]
    path = str(PEERS / name)
    good, problems = read_and_parse([path], kind)
    assert len(good) + len(problems) == sum(1 for _ in read_entry(path))  # every record counted
    if isinstance(outcome, int):
        assert (len(good), problems) == (outcome, [])
    else:
        lines = summarize(problems)
        assert not good and len(lines) == 1 and outcome in lines[0], lines


def _train_cfg(cfg, model, files, out, steps):
    cfg.model.path, cfg.output_dir = str(model), str(out)
    cfg.data.train, cfg.data.eval = [str(PEERS / f) for f in files], []
    cfg.train.max_steps, cfg.train.batch_size, cfg.train.grad_accum, cfg.train.seq_length = steps, 1, 1, 512
    cfg.data.truncation = "truncate"  # the longest excerpts lose whole late turns (counted in the stats)
    cfg.train.eval_steps, cfg.train.warmup = 0, 0
    cfg.lora.r = 4
    cfg.checkpoint.resume, cfg.checkpoint.save_interval = False, "1000h"
    cfg.tracking.trackers = []
    return cfg


def _files(kind):
    return [f for f, (k, outcome) in EXPECTED.items() if k == kind and isinstance(outcome, int)]


def test_sft_trains_two_steps_on_every_peer_sft_file_tool_calls_included(tiny_model_dir, tmp_path):
    from stages.sft import SFTConfig, SFTStage

    run = run_stage(SFTStage, _train_cfg(SFTConfig(), tiny_model_dir, _files("sft"), tmp_path / "sft", 2))
    assert len(run.history.steps) == 2
    assert sorted(run.tasks) == sorted(
        {Path(f).stem for f in _files("sft")}
    )  # every file gave samples (tasks by file stem)
    saved = (
        json.loads((tmp_path / "sft" / "merged" / "tokenizer_config.json").read_text()).get("chat_template")
        or (tmp_path / "sft" / "merged" / "chat_template.jinja").read_text()
    )
    assert "<tool_call>" in saved  # the default tool layout went into the merged model's template


def test_dpo_trains_two_steps_on_every_peer_preference_file(tiny_model_dir, tmp_path):
    from stages.dpo import DPOConfig, DPOStage

    run = run_stage(DPOStage, _train_cfg(DPOConfig(), tiny_model_dir, _files("rm"), tmp_path / "dpo", 2))
    assert len(run.history.steps) == 2
    # every file gave pairs (the longest lose their oldest prompt tokens or, answer alone too long, are dropped and
    # counted)
    assert {s["source"].rsplit(":", 1)[0] for s in run.train_samples} == {str(PEERS / f) for f in _files("rm")}
    saved = (
        json.loads((tmp_path / "dpo" / "merged" / "tokenizer_config.json").read_text()).get("chat_template")
        or (tmp_path / "dpo" / "merged" / "chat_template.jinja").read_text()
    )
    assert "<tool_call>" in saved  # tool answers trained in the default layout: the merged template renders them so


def test_pt_trains_a_step_on_every_peer_text_file(tiny_model_dir, tmp_path):
    from stages.pretrain import PTConfig, PTStage

    cfg = _train_cfg(PTConfig(), tiny_model_dir, _files("pt"), tmp_path / "pt", 1)
    cfg.train.seq_length = 256
    run = run_stage(PTStage, cfg)
    assert len(run.history.steps) == 1


ANSWERS_SEEN: list = []


def record_answers(prompts, completions, answer=None, **columns):
    """A reward function that records the `answer` keyword it was given (TRL's extra columns)."""
    ANSWERS_SEEN.extend(answer)
    return [0.0] * len(completions)


def test_grpo_passes_each_prompt_records_answer_to_reward_functions(tiny_model_dir, tmp_path):
    from stages.grpo import GRPOConfig, GRPOStage

    cfg = _train_cfg(GRPOConfig(), tiny_model_dir, _files("prompts"), tmp_path / "grpo", 1)
    cfg.grpo.reward_funcs = ["test_peer_data:record_answers", "pipeline.algorithms.rewards:answer_match"]
    cfg.grpo.num_generations, cfg.generation.max_new_tokens = 2, 4
    ANSWERS_SEEN.clear()
    run = run_stage(GRPOStage, cfg)
    records = [json.loads(line) for line in (PEERS / _files("prompts")[0]).read_text(encoding="utf-8").splitlines()]
    assert len(run.history.steps) == 1 and ANSWERS_SEEN and set(ANSWERS_SEEN) <= {r["answer"] for r in records}


@pytest.mark.parametrize(
    "stage,kind", [("dpo", "rm"), ("grpo", "prompts"), ("ppo", "prompts"), ("rm", "rm"), ("sft", "sft"), ("pt", "pt")]
)
def test_validate_kind_takes_every_stage_name(stage, kind):
    from pipeline.tools.cli import data_kind_args

    assert data_kind_args(["--kind", stage, "f.jsonl"]) == ["--kind", kind, "f.jsonl"]
    assert data_kind_args([f"--kind={stage}"]) == [f"--kind={kind}"]


@pytest.mark.parametrize("command", ["validate", "show"])
def test_an_unknown_kind_is_one_line_naming_stages_and_data_kinds(command, capsys):
    from pipeline.tools.cli import main

    assert main([command, "--kind", "dpo2", "f.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'dpo2'" in err and "grpo" in err and "prompts" in err, err
