"""LLaMA-Factory's dataset registry read as it is: a data entry `FOLDER/dataset_info.json:NAME`
(data_formats.llamafactory_registry) yields exactly what pointing at the entry's file
yields, for LLaMA-Factory's own registry entries of its demo files (tests/data/peers/LLaMA-Factory,
SOURCES.md) and for entries that rename columns and tags; what Relay cannot honour is one line
naming the entry."""

import json
from pathlib import Path

import pytest

from data_formats.datasets import build_preference_data, build_sft_data
from data_formats.pt_data import build_pt_data
from data_formats.render import make_template
from data_formats.unpaired import build_kto_data
from data_formats.validate import data_problems
from pipeline.config.sections import ChatDataConfig, PreferenceDataConfig, TextDataConfig

LF = Path(__file__).resolve().parent / "data" / "peers" / "LLaMA-Factory"
INFO = LF / "dataset_info.json"
SEQ = 2048


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from pipeline.modeling.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def build(kind: str, entry: str, tokenizer) -> list[dict]:
    if kind == "pt":
        return build_pt_data(TextDataConfig(train=[entry]), tokenizer, SEQ, "train")
    cfg = {"sft": ChatDataConfig, "rm": PreferenceDataConfig, "kto": ChatDataConfig}[kind](train=[entry])
    template = make_template(cfg, tokenizer)
    if kind == "sft":
        built = build_sft_data(cfg, tokenizer, template, SEQ, "train")
        return [dict(s, task=built.tasks[s["task_id"]]) for s in built.samples]
    if kind == "rm":
        return build_preference_data(cfg, tokenizer, template, SEQ, "train")
    return build_kto_data(cfg, tokenizer, template, SEQ, "train")


# LLaMA-Factory's own registry entries for the demo files Relay trains (its data/dataset_info.json).
DEMOS = [
    ("sft", "alpaca_en_demo", "alpaca_en_demo.json"),
    ("sft", "alpaca_zh_demo", "alpaca_zh_demo.json"),
    ("sft", "glaive_toolcall_en_demo", "glaive_toolcall_en_demo.json"),
    ("rm", "dpo_en_demo", "dpo_en_demo.json"),
    ("rm", "dpo_zh_demo", "dpo_zh_demo.json"),
    ("kto", "kto_en_demo", "kto_en_demo.json"),
    ("pt", "c4_demo", "c4_demo.jsonl"),
    ("pt", "wiki_demo", "wiki_demo.txt"),
]


@pytest.mark.parametrize("kind,name,file", DEMOS, ids=[d[1] for d in DEMOS])
def test_a_registry_entry_of_a_demo_file_yields_what_the_file_yields(kind, name, file, tokenizer):
    direct = build(kind, str(LF / file), tokenizer)
    named = build(kind, f"{INFO}:{name}", tokenizer)
    assert direct and named == direct  # token ids, labels (masks), sources and tasks, every field


def write(path: Path, value) -> Path:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def test_renamed_columns_and_tags_yield_what_the_standard_layout_yields(tokenizer, tmp_path):
    alpaca = json.loads((LF / "alpaca_en_demo.json").read_text(encoding="utf-8"))
    write(tmp_path / "qa.json", [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in alpaca])
    chats = json.loads((LF / "glaive_toolcall_en_demo.json").read_text(encoding="utf-8"))
    roles = {"human": "U", "gpt": "A", "function_call": "F", "observation": "O"}
    write(
        tmp_path / "chats.json",
        [
            {
                "dialog": [{"who": roles[m["from"]], "says": m["value"]} for m in r["conversations"]],
                "schema": r["tools"],
            }
            for r in chats
        ],
    )
    write(
        tmp_path / "dataset_info.json",
        {
            "qa": {"file_name": "qa.json", "columns": {"prompt": "q", "query": "ctx", "response": "a"}},
            "chats": {
                "file_name": "chats.json",
                "formatting": "sharegpt",
                "columns": {"messages": "dialog", "tools": "schema"},
                "tags": {
                    "role_tag": "who",
                    "content_tag": "says",
                    "user_tag": "U",
                    "assistant_tag": "A",
                    "function_tag": "F",
                    "observation_tag": "O",
                },
            },
        },
    )
    for name, file in (("qa", "alpaca_en_demo.json"), ("chats", "glaive_toolcall_en_demo.json")):
        named = build("sft", f"{tmp_path / 'dataset_info.json'}:{name}", tokenizer)
        direct = build("sft", str(LF / file), tokenizer)
        assert [(s["input_ids"], s["labels"]) for s in named] == [(s["input_ids"], s["labels"]) for s in direct]


def test_system_and_history_columns_become_turns(tokenizer, tmp_path):
    write(
        tmp_path / "h.json",
        [{"instruction": "and 3+3?", "input": "", "output": "6", "system": "Be brief.", "history": [["2+2?", "4"]]}],
    )
    write(
        tmp_path / "m.json",
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "and 3+3?"},
                    {"role": "assistant", "content": "6"},
                ]
            }
        ],
    )
    write(
        tmp_path / "dataset_info.json",
        {
            "h": {
                "file_name": "h.json",
                "columns": {
                    "prompt": "instruction",
                    "query": "input",
                    "response": "output",
                    "system": "system",
                    "history": "history",
                },
            }
        },
    )
    named = build("sft", f"{tmp_path / 'dataset_info.json'}:h", tokenizer)
    direct = build("sft", str(tmp_path / "m.json"), tokenizer)
    assert [(s["input_ids"], s["labels"]) for s in named] == [(s["input_ids"], s["labels"]) for s in direct]


def test_entries_relay_cannot_honour_are_one_line_naming_the_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lines = data_problems(
        [f"{INFO}:mllm_demo", f"{INFO}:alpaca_en", f"{INFO}:alpaca_en_dem", f"{tmp_path}/dataset_info.json:x"],
        "data.train",
    )
    assert lines == [
        f"data.train: {INFO}:mllm_demo: multimodal column(s) ['images']: Relay trains text-only language models",
        f"data.train: {INFO}:alpaca_en: a hub dataset (hf_hub_url 'llamafactory/alpaca_en') cannot be read offline "
        f"(HF_HUB_OFFLINE); download it and point file_name at the local file",
        f"data.train: {INFO}:alpaca_en_dem: no entry 'alpaca_en_dem' in {INFO}; did you mean 'alpaca_en_demo'?",
        f"data.train: {tmp_path}/dataset_info.json:x: no such file {tmp_path}/dataset_info.json",
    ]
    write(
        tmp_path / "dataset_info.json",
        {
            "n": {"file_name": "a.json", "num_samples": 10},
            "f": {"file_name": "a.json", "formatting": "openai"},
            "c": {"file_name": "a.json", "columns": {"answer": "a"}},
            "gone": {"file_name": "missing.json"},
        },
    )
    lines = data_problems([f"{tmp_path}/dataset_info.json:{n}" for n in ("n", "f", "c", "gone")], "data.eval")
    assert [line.split(": ", 2)[2] for line in lines] == [
        "num_samples: LLaMA-Factory draws that many records at random; use data.max_samples (the first N)",
        "formatting 'openai': Relay reads LLaMA-Factory's alpaca and sharegpt formattings",
        "column(s) ['answer'] are not alpaca columns (known: prompt, query, response, history, system, tools, chosen, "
        "rejected, kto_tag)",
        f"its file_name {tmp_path}/missing.json does not exist",
    ]


def test_a_stage_refuses_the_entry_before_any_model_loads(tmp_path):
    from pipeline.config import ConfigError, load_config
    from stages.sft import SFTConfig, SFTStage

    cfg = load_config(
        SFTConfig,
        [
            "--model.path",
            str(tmp_path / "no-model"),
            "--data.train",
            f"[{INFO}:mllm_demo]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(tmp_path / "o"),
        ],
    )
    with pytest.raises(ConfigError) as err:
        SFTStage(cfg).validate()
    assert (
        f"data.train: {INFO}:mllm_demo: multimodal column(s) ['images']: Relay trains text-only language models"
        in err.value.problems
    )


def test_a_record_missing_a_mapped_column_is_its_file_and_line(tokenizer, tmp_path):
    from data_formats.validate import read_and_parse

    write(tmp_path / "qa.json", [{"q": "hi", "a": "hello"}, {"q": "bye"}])
    write(tmp_path / "dataset_info.json", {"qa": {"file_name": "qa.json", "columns": {"prompt": "q", "response": "a"}}})
    good, problems = read_and_parse([f"{tmp_path / 'dataset_info.json'}:qa"], "sft")
    assert len(good) == 1 and good[0].task == "qa"
    assert [str(p) for p in problems] == [
        f"{tmp_path / 'qa.json'}:6: missing field 'a' (the response column of {tmp_path / 'dataset_info.json'}:qa)"
    ]


def test_an_alpaca_file_read_directly_keeps_its_system_and_history_as_the_registry_does(tokenizer, tmp_path):
    """The same Alpaca file with `system` and `history`, read as a data path and through a registry
    entry, trains the same tokens (read directly, both fields were dropped without a word: the last
    round alone under the model's default system prompt); as a PPO/GRPO prompt it is the whole
    conversation up to its question; a history or system of the wrong shape is its record's problem."""
    from data_formats.records import parse_prompt
    from data_formats.validate import read_and_parse

    record = {"instruction": "and 3+3?", "input": "", "output": "6", "system": "Be brief.", "history": [["2+2?", "4"]]}
    write(tmp_path / "h.json", [record])
    write(
        tmp_path / "dataset_info.json",
        {"h": {"file_name": "h.json", "columns": {"system": "system", "history": "history"}}},
    )
    named = build("sft", f"{tmp_path / 'dataset_info.json'}:h", tokenizer)
    direct = build("sft", str(tmp_path / "h.json"), tokenizer)
    assert [(s["input_ids"], s["labels"]) for s in direct] == [(s["input_ids"], s["labels"]) for s in named]
    prompt = parse_prompt({k: v for k, v in record.items() if k != "output"}, "alpaca", system_prompt="Other.")
    assert [(t.role, t.content) for t in prompt.turns] == [
        ("system", "Be brief."),
        ("user", "2+2?"),
        ("assistant", "4"),
        ("user", "and 3+3?"),
    ]
    assert prompt.meta == {}
    bad = [{**record, "history": "2+2? 4"}, {**record, "history": [["2+2?"]]}, {**record, "system": ["Be brief."]}]
    write(tmp_path / "bad.json", bad)
    _, problems = read_and_parse([str(tmp_path / "bad.json")], "sft", fmt="alpaca")
    assert [p.reason for p in problems] == [
        "field 'history' must be a list of [instruction, response] pairs, got a string",
        "history[0]: must be an [instruction, response] pair of non-empty strings, got ['2+2?']",
        "field 'system' must be a string, got an array",
    ]
