"""The judge's SFT data (bench/train_judge.py): each preference pair becomes the judge's own request for
the chosen answer answered "Yes" and for the rejected one answered "No", rendered exactly as a judge
request is (pipeline/algorithms/judge.py render_messages), so the trained judge sees at serve time what
it was trained on."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_judge import LABELS, judge_sft_records  # noqa: E402
from pipeline.algorithms.judge import JudgeConfig, label_key, render_messages  # noqa: E402

PAIR = {
    "question": "What is the capital of Oru?",
    "response_chosen": "Per the Kelvra Atlas, Tessel.",
    "response_rejected": "No idea.",
}


def test_two_conversations_per_pair_chosen_yes_rejected_no():
    cfg = JudgeConfig(base_url="http://x/v1", model="j", template="Q: {question}\nA: {answer}\nOK?", system="Judge.")
    records = judge_sft_records([PAIR], cfg)
    assert records == [
        {
            "messages": [
                {"role": "system", "content": "Judge."},
                {"role": "user", "content": "Q: What is the capital of Oru?\nA: Per the Kelvra Atlas, Tessel.\nOK?"},
                {"role": "assistant", "content": "Yes"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Judge."},
                {"role": "user", "content": "Q: What is the capital of Oru?\nA: No idea.\nOK?"},
                {"role": "assistant", "content": "No"},
            ]
        },
    ]
    assert records[0]["messages"][:-1] == render_messages(cfg, PAIR["question"], PAIR["response_chosen"])


def test_labels_are_the_rubric_choices():
    from bench.judge_outcome import RUBRICS

    choices = {label_key(k): v for k, v in RUBRICS["choice"]["choices"].items()}
    assert [choices[label_key(label)] for label in LABELS] == [1.0, 0.0]


def test_a_pair_missing_a_field_is_a_key_error():
    with pytest.raises(KeyError):
        judge_sft_records([{"question": "q", "response_chosen": "a"}], JudgeConfig(template="{answer}"))
