"""The capability table (pipeline/config/capabilities.py) walked cell by cell: every supported cell
names tests that exist, every other one is refused by `refusal` in one line, no cell is neither;
`relay validate` and `relay train --nproc N` print the refusal and stop before any model loads or
any rank starts; the README carries the code's table."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from pipeline.config import capabilities as cap
from pipeline.config import capability_table as table
from pipeline.tools import cli

ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _test_functions(path: str) -> tuple[set[str], str]:
    """(the test functions a test file defines, its text), read without importing it."""
    text = (ROOT / path).read_text(encoding="utf-8")
    names = {
        node.name for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return {n for n in names if n.startswith("test_")}, text


def node_exists(node: str) -> bool:
    """Whether a pytest node id names a test function of a file, and each part of its parameter id
    appears in that file (a literal or a registry the file parametrizes over)."""
    match = re.fullmatch(r"([\w/]+\.py)::(\w+)(?:\[(.+)\])?", node)
    if not match or not (ROOT / match.group(1)).is_file():
        return False
    names, text = _test_functions(match.group(1))
    if match.group(2) not in names:
        return False
    params = match.group(3)
    return params is None or all(part in text for part in re.split(r"[-/]", params) if not part.isdigit())


def test_the_capability_module_imports_no_torch():
    code = "import sys; from pipeline.config import capability_table as c; c.render(); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_every_cell_is_tested_or_refused_in_one_line():
    tested = refused = 0
    for cell in cap.cells():
        line = cap.refusal(cell)
        if line is None:
            nodes = cap.TESTS[cell]
            assert nodes and all(node_exists(n) for n in nodes), (cell, [n for n in nodes if not node_exists(n)])
            tested += 1
        else:
            assert "\n" not in line and re.match(r"^[\w.]+( [^:]+)?: ", line), line
            refused += 1
        assert cap.refusal(cell, cuda=False) is None or isinstance(cap.refusal(cell, cuda=False), str)
    assert tested and refused and tested + refused == len(list(cap.cells()))
    assert (tested, refused) == table.counts()[:2]
    assert set(cap.TESTS) <= set(cap.cells())  # no test names a cell the table lacks
    print(f"capability table: {tested} cells tested, {refused} refused")


def test_the_tools_axis_is_the_stages_with_a_tools_section():
    """A stage's tools axis is "on"/"off" exactly where its config has a `tools:` section (distill
    has none: `--tools.funcs` is an unknown key there, so no cell of it has tools on)."""
    import dataclasses

    from stages import STAGES, config_class

    for name, info in STAGES.items():
        has = any(f.name == "tools" for f in dataclasses.fields(config_class(name)))
        assert info.tools == has, name
        axis = {cell.tools for cell in cap.cells() if cell.stage == name}
        assert axis == (set(cap.TOOLS) if has else {cap.NONE}), (name, axis)


def test_the_correction_axis_is_the_stages_whose_loss_weighs_tokens():
    """Only PPO's and GRPO's losses take the correction's per-token weight; distill's axis is "-" (its loss has no
    per-token weight) and an explicit tis or mis there is refused (`REFUSED`), auto and none are not."""
    from types import SimpleNamespace

    from pipeline.config.policy import CORRECTIONS
    from stages import STAGES

    for name, info in STAGES.items():
        axis = {cell.correction for cell in cap.cells() if cell.stage == name}
        assert axis == (set(CORRECTIONS) if info.corrects else {cap.NONE}), (name, axis)
    assert {name for name, info in STAGES.items() if info.corrects} == {"ppo", "grpo"}
    for correction in ("auto", "none"):
        cfg = SimpleNamespace(
            distributed=SimpleNamespace(engine="ddp", deepspeed_config=None),
            model=SimpleNamespace(finetuning="lora"),
            generation=SimpleNamespace(backend="relay", correction=correction),
        )
        assert cap.config_cell("distill", cfg, 1) == (cap.Cell("distill", "relay", cap.NONE, "lora"), None)


def test_grpo_options_are_the_registries():
    from pipeline.algorithms.advantages import ESTIMATORS
    from pipeline.algorithms.grpo_losses import LOSS_TYPES

    assert set(cap.GRPO_OPTIONS["loss_type"]) == set(LOSS_TYPES)
    assert set(cap.GRPO_OPTIONS["advantage_estimator"]) == set(ESTIMATORS)
    assert all(node_exists(n) for names in cap.GRPO_OPTIONS.values() for nodes in names.values() for n in nodes)


def test_every_judge_cell_is_tested_or_refused_in_one_line():
    walked = list(cap.judge_cells())
    assert set(cap.JUDGE_TESTS) <= set(walked) and {s for s, _, _ in walked} <= set(cap.policy_stages())
    for stage, tools, engine in walked:
        line = cap.judge_refusal(stage, tools, engine)
        if line is None:
            assert all(node_exists(n) for n in cap.JUDGE_TESTS[stage, tools, engine]), (stage, tools, engine)
        else:
            assert "\n" not in line and line.startswith("judge.base_url: "), line
    assert any(cap.judge_refusal(*c) for c in walked) and "`judge:`" in table.render()


def test_known_refusals_are_the_tables():
    vllm_ddp = cap.Cell("grpo", "vllm", "off", "lora", "ddp", "tis")
    assert "until per-rank servers are pinned to their device" in cap.refusal(vllm_ddp)
    assert cap.refusal(cap.Cell("grpo", "vllm", "off", "lora", "single", "tis")) is None
    assert cap.refusal(cap.Cell("sft", adapter="qlora", engine="fsdp")).startswith(
        "distributed.engine: fsdp cannot shard QLoRA"
    )
    zero = cap.Cell("sft", adapter="lora", engine="zero3")
    assert (
        cap.refusal(zero, cuda=True) is None and cap.refusal(zero, cuda=False) is None
    )  # ZeRO trains on CPU ranks too
    assert cap.refusal(cap.Cell("ppo", "relay", "off", "lora", "single", "tis")).startswith(
        "generation.correction: tis"
    )
    assert cap.refusal(cap.Cell("sft", adapter="qlora", engine="single")) is None  # bitsandbytes' 4-bit runs on CPU


def test_the_readme_carries_the_codes_table():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = table.readme_block(text)
    if block is None:
        pytest.skip(f"README.md has no {table.BEGIN} markers yet: place them, then `relay capabilities --write-readme`")
    assert block == table.render(), "README's capability table is stale: run `relay capabilities --write-readme`"


def test_write_readme_touches_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\n\nbefore\n{table.BEGIN}\nold\n{table.END}\nafter\n")
    assert cli.main(["capabilities", "--write-readme", str(readme)]) == 0
    text = readme.read_text()
    assert (
        text.startswith("# T\n\nbefore\n")
        and text.endswith(f"{table.END}\nafter\n")
        and table.readme_block(text) == table.render()
    )
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    assert cli.main(["capabilities", "--write-readme", str(bare)]) == 2 and bare.read_text() == "no markers\n"


TOOL = '''def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: one
        b: the other
    """
    return a + b
'''
CONFIGS = Path(__file__).resolve().parents[1] / "deepspeed_configs"
ZERO2 = ["--distributed.engine", "deepspeed", "--distributed.deepspeed_config", str(CONFIGS / "zero2.json")]
UNTESTED = "combination "
"""The start of the line for a cell no test runs."""
REFUSED = [
    # (stage, --nproc, overrides, the start of the line)
    (
        "grpo",
        2,
        ["--generation.backend", "vllm"],
        "generation.backend: vllm with more than one rank is refused until per-rank servers",
    ),
    ("ppo", 1, ["--generation.correction", "mis"], "generation.correction: mis weighs each token"),
    (
        "distill",
        1,
        ["--generation.backend", "vllm", "--generation.correction", "tis"],
        "generation.correction: tis weighs a policy loss's tokens by p_trainer / p_engine and distill's loss has no",
    ),
    (
        "ppo",
        2,
        ["--judge.base_url", "http://127.0.0.1:9/v1", "--judge.model", "m", "--distributed.engine", "fsdp"],
        "judge.base_url: a judge reward in ppo with tools off under FSDP2 is not run",
    ),
    (
        "grpo",
        2,
        ["--judge.base_url", "http://127.0.0.1:9/v1", "--judge.model", "m", "--judge.max_concurrency", "1"],
        "judge.max_concurrency: 1 requests in flight cannot be shared by the 2 ranks that each ask",
    ),
    (
        "grpo",
        2,
        ["--generation.backend", "hf", "--tools.funcs", "[{tools}]", *ZERO2],
        "combination stage grpo x backend hf x tools on x adapter lora x engine zero2 x correction none: not run by",
    ),
    (
        "sft",
        1,
        ["--model.finetuning", "qlora", "--distributed.engine", "fsdp"],
        "distributed.engine: fsdp cannot shard QLoRA",
    ),
]


def write_config(tmp_path: Path, stage: str, model: Path, reward: Path) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "Hi?"}\n')
    lines = [
        f"# python stages/{stage}.py",
        f"output_dir: {tmp_path / 'out'}",
        f"model: {{path: {model}}}",
        f"data: {{train: [{data}]}}",
    ]
    if stage in ("ppo", "grpo"):
        lines.append(f"reward_model: {{path: {reward}}}")
    if stage == "distill":
        lines.append(f"teacher: {{path: {model}}}")
    path = tmp_path / f"{stage}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("stage,nproc,overrides,line", REFUSED)
def test_validate_prints_the_refusal_before_any_model_loads(
    stage, nproc, overrides, line, tmp_path, tiny_model_dir, tiny_reward_dir, monkeypatch, capsys
):
    from pipeline.modeling import models
    from stages import STAGES, stage_class

    def no_load(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    for name in STAGES:  # imported before the patch: a stage module first imported under it would keep no_load
        stage_class(name)
    monkeypatch.setattr(models, "load_model", no_load)
    monkeypatch.setattr(models, "load_tokenizer", no_load)
    if line.startswith(UNTESTED):  # every cell has its test today: one is taken out for the line a new one gets
        cell = line.removeprefix(UNTESTED).removesuffix(": not run by")
        kept = {c: t for c, t in cap.TESTS.items() if c.describe() != cell}
        assert len(kept) == len(cap.TESTS) - 1
        monkeypatch.setattr(cap, "TESTS", kept)
    config = write_config(tmp_path, stage, tiny_model_dir, tiny_reward_dir)
    tools = tmp_path / "tools.py"  # "{tools}": a tool a stage may call
    tools.write_text(TOOL)
    overrides = [o.replace("{tools}", f"{tools}:add") for o in overrides]
    assert cli.main(["validate", str(config), "--nproc", str(nproc), *overrides]) == 2
    err = capsys.readouterr().err
    assert sum(1 for row in err.splitlines() if row.strip("  -").startswith(line)) == 1, err


def test_train_refuses_before_torchrun_starts_a_rank(tmp_path, tiny_model_dir, tiny_reward_dir, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(cli, "hand_over", lambda *a, **k: started.append(a) or 0)
    config = write_config(tmp_path, "grpo", tiny_model_dir, tiny_reward_dir)
    assert cli.main(["train", str(config), "--nproc", "2", "--generation.backend", "vllm"]) == 2
    assert not started
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "until per-rank servers are pinned to their device" in err[0]
    assert cli.main(["train", str(config), "--nproc", "2"]) == 0 and started  # the supported cell launches


def test_the_table_piped_into_a_closed_reader_ends_without_a_traceback():
    """`relay capabilities | head -1`: the reader may close the pipe before the table is written."""
    relay = Path(sys.executable).with_name("relay")
    proc = subprocess.Popen([str(relay), "capabilities"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # closed before the command has imported anything: its print meets a broken pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_train_with_a_judge_launches_or_refuses_in_one_line(
    tmp_path, tiny_model_dir, tiny_reward_dir, monkeypatch, capsys
):
    """`relay train` asks the table before it starts a rank; with a judge set (and tools) the table
    asks the judge whether it serves N ranks: that ended in an AttributeError traceback, the
    judge section being a plain namespace there."""
    started = []
    monkeypatch.setattr(cli, "hand_over", lambda *a, **k: started.append(a) or 0)
    config = write_config(tmp_path, "grpo", tiny_model_dir, tiny_reward_dir)
    judged = ["--judge.base_url", "http://127.0.0.1:9/v1", "--judge.model", "m"]
    tools = ["--tools.funcs", "[data_formats.sample_world:kelvra_lookup]"]
    assert cli.main(["train", str(config), *judged, *tools]) == 0 and started
    started.clear()
    assert cli.main(["train", str(config), *judged, *tools, "--nproc", "2", "--judge.max_concurrency", "1"]) == 2
    assert not started
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "judge.max_concurrency: 1 requests in flight cannot be shared by the 2 ranks" in line
