"""The backend registries: the generation backends (pipeline/config/backends.py's facts,
pipeline/rl/rollout.py's GENERATORS) and the serving backends (pipeline/tools/serving.py and
each command's table) agree on their names, and a backend added as entries alone (monkeypatched
here, no other file touched) reaches every place that asks about backends: the config checks,
`correction: auto`, the capability table, a stage's validation, `make_generator`, `relay chat`'s
sampling check, the gold config and cache key, and `relay serve`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pipeline.config import ConfigError, GenerationConfig, backends, capability_table
from pipeline.config import capabilities as cap
from pipeline.rl import generators
from pipeline.tools import chat, gold, serve, serving

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("pipeline", "stages") for p in sorted((ROOT / d).rglob("*.py"))]
NAME_BRANCH = re.compile(r'backend\s*(==|!=)\s*"|backend\s*(not\s+)?in\s*\("|"[a-z_]+"\s*(==|!=)\s*[a-z_.]*backend\b')


def test_the_registries_name_the_same_backends():
    assert list(generators.GENERATORS) == list(backends.BACKENDS)
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    for name, entry in backends.BACKENDS.items():
        assert set(entry.options) <= fields, f"{name}'s options must be generation keys"
    assert list(chat.CHAT_MODELS) == list(gold.GREEDY) == list(serve.SERVERS) == list(serving.SERVING)
    assert serving.DEFAULT in serving.SERVING


def test_no_code_branches_on_a_backend_name():
    """Callers ask a backend's entry; none compares a backend with a literal name."""
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if NAME_BRANCH.search(line)
    ]
    assert not found, found


@pytest.fixture
def fake_generation(monkeypatch):
    """A generation backend registered as its two entries only: it reports engine log-probs, owns
    no server, checks one option's value, and has a device and a runtime problem to report."""
    made = []

    class FakeGenerator:
        def __init__(self, **options):
            self.options = options
            made.append(self)

        def generate(self, prompts, *, max_new_tokens=None):
            return [[7] for _ in prompts]

    def option_problems(gen, key):
        return [f"{key}.temperature: fake samples at most at 2"] if gen.temperature > 2 else []

    monkeypatch.setitem(
        backends.BACKENDS,
        "fake",
        backends.Backend(
            "a stand-in",
            engine_logprobs=True,
            own_server=False,
            option_problems=option_problems,
            device_problems=lambda gen, cuda_devices, key: [f"{key}.backend: fake needs {cuda_devices + 1} GPUs"],
        ),
    )
    monkeypatch.setitem(
        generators.GENERATORS,
        "fake",
        generators.GeneratorSpec(
            lambda model, pad_id, eos_ids, max_new_tokens, temperature=1.0, *, synced_gpus=False, **engine: (
                FakeGenerator(pad_id=pad_id, eos_ids=list(eos_ids), max_new_tokens=max_new_tokens, **engine)
            ),
            engine=lambda cfg, model_path: {"base": model_path},
            problems=lambda cfg, model_path: ["generation.backend: fake is not installed"],
        ),
    )
    return made


def test_a_new_generation_backend_is_its_entries(fake_generation, tmp_path, tiny_model_dir, monkeypatch):
    from test_grpo import make_cfg

    from stages import grpo

    # config checks and the correction auto resolves to
    assert (
        GenerationConfig(backend="fake").problems() == [] and GenerationConfig(backend="fake").correction_name == "tis"
    )
    assert GenerationConfig(backend="sglang").problems() == [
        "generation.backend: 'sglang' is not one of ('relay', 'hf', 'vllm', 'fake')"
    ]
    assert GenerationConfig(temperature=3.0).problems() == ["generation.temperature: fake samples at most at 2"]

    # the capability table: its cells exist, are refused until a test trains them, then listed
    cell = cap.Cell("grpo", "fake", "off", "lora", "single", "tis")
    assert cell in set(cap.cells())
    assert "not run by Relay's test suite yet" in cap.refusal(cell)
    assert cap.refusal(dataclasses.replace(cell, engine="fsdp")).startswith("combination ")  # no server to refuse
    monkeypatch.setitem(cap.TESTS, cell, ("tests/test_backends.py",))
    assert cap.refusal(cell) is None and "| grpo | fake | off | tis | lora | yes |" in capability_table.render()

    # a stage's config: its cell, and the entries' problems before any model loads
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts, max_steps=1)
    cfg.generation.backend = "fake"
    assert cap.config_cell("grpo", cfg, ranks=1) == (cell, None)
    with pytest.raises(ConfigError) as err:
        grpo.GRPOStage(cfg).validate()
    assert "generation.backend: fake is not installed" in err.value.problems
    assert any(p.startswith("generation.backend: fake needs") and p.endswith("GPUs") for p in err.value.problems)

    # the sampler
    sampler = generators.make_generator("fake", None, 0, (2,), 4, **generators.GENERATORS["fake"].engine(cfg, "/m"))
    assert sampler is fake_generation[-1] and sampler.options == {
        "pad_id": 0,
        "eos_ids": [2],
        "max_new_tokens": 4,
        "base": "/m",
    }
    assert sampler.generate([[1, 2]]) == [[7]]


def test_a_new_serving_backend_is_its_entries(monkeypatch, tiny_model_dir, capsys):
    from pipeline.tools.chain_config import GoldConfig

    served = []
    monkeypatch.setitem(
        serving.SERVING,
        "fake",
        serving.ServingBackend("Fake", "fakeserve", ("temperature",), missing=lambda: "fake is not installed"),
    )
    monkeypatch.setitem(chat.CHAT_MODELS, "fake", lambda *a, **k: pytest.fail("no model opens here"))
    monkeypatch.setitem(gold.GREEDY, "fake", lambda *a: pytest.fail("no model decodes here"))
    monkeypatch.setitem(serve.SERVERS, "fake", lambda args: served.append(args.model) or 0)

    assert chat.unsupported_sampling("fake", chat.Generation(top_k=5)) == (
        "--backend fake samples with temperature only: drop --top-k/--repetition-penalty"
    )
    assert chat.unsupported_sampling("fake", chat.Generation(temperature=0.7)) is None
    assert chat.parse_args(["--model", "m", "--backend", "fake"]).backend == "fake"
    assert gold.GoldSettings(backend="fake").key()["backend"] == "fake"
    assert GoldConfig(backend="fake", data=str(ROOT / "data" / "sample" / "gold" / "eval.jsonl")).problems() == [
        "gold.backend: fake is not installed"
    ]
    assert serve.main([str(tiny_model_dir), "--backend", "fakeserve"]) == 0 and served == [str(tiny_model_dir)]
    assert serve.main([str(tiny_model_dir), "--backend", "fakeserve", "--eager"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --eager is a vLLM option (--backend vllm)"
