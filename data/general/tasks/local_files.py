"""The local files of Relay's general tasks, read beside this file (the harness calls these through
`custom_dataset: !function local_files.NAME`), so the tasks run from any working directory and
nothing is downloaded."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _split(name: str) -> datasets.DatasetDict:
    with open(HERE / name, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def general_mc(**_):
    return _split("general_mc.jsonl")


def general_text(**_):
    return _split("general_text.jsonl")
