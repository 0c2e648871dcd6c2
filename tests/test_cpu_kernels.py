"""Which CPU fast paths a machine takes (pipeline/modeling/cpu_kernels.py): the pure decision, the
overrides, the per-machine cache, the paired timing on a scripted clock, and that the engine's
contexts follow the choice."""

from __future__ import annotations

import pytest
import torch

from pipeline.modeling import cpu_kernels, onednn

# Issue 33's figures (GFLOP/s, fp32, 2-core AMD EPYC with AVX2 only) as speedups of the fast path:
# training shapes 115 (oneDNN) vs 144 (MKL); decode shapes 53 vs 46 and on the LM head 37 vs 16.
AVX2_EPYC = {"train_onednn": 115 / 144, "decode_packed": 53 / 46, "decode_fused": 1.12}
# bench/RESULTS.md's reference AMD EPYC with AVX-512: ~490 vs ~215 and ~260 vs ~80.
AVX512_EPYC = {"train_onednn": 490 / 215, "decode_packed": 260 / 80, "decode_fused": 1.3}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A private cache folder, no overrides, no choice remembered from earlier in the process."""
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path))
    for name in cpu_kernels.PATHS.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_kernels, "_CHOICES", {})
    monkeypatch.setattr(cpu_kernels, "load_per_core", lambda: 0.1)  # a quiet machine unless a test says otherwise
    return tmp_path


def test_decide_takes_a_path_only_where_it_pays():
    assert cpu_kernels.decide(AVX2_EPYC) == {"train_onednn": False, "decode_packed": True, "decode_fused": True}
    assert cpu_kernels.decide(AVX512_EPYC) == {"train_onednn": True, "decode_packed": True, "decode_fused": True}
    # fused siblings are a prepacked path: never without packing; a missing figure is not taken
    assert cpu_kernels.decide({"decode_packed": 1.0, "decode_fused": 2.0}) == dict.fromkeys(cpu_kernels.PATHS, False)
    edge = cpu_kernels.MARGIN
    assert cpu_kernels.decide({"train_onednn": edge}, margin=edge)["train_onednn"]
    assert not cpu_kernels.decide({"train_onednn": edge - 1e-9}, margin=edge)["train_onednn"]


def test_overrides_force_a_path_and_a_bad_value_is_one_clear_error():
    assert cpu_kernels.override("train_onednn", {}) is None
    assert cpu_kernels.override("train_onednn", {"RELAY_CPU_ONEDNN": "auto"}) is None
    assert cpu_kernels.override("decode_packed", {"RELAY_DECODE_PACKED": "0"}) is False
    assert cpu_kernels.override("decode_fused", {"RELAY_DECODE_FUSED": " 1 "}) is True
    with pytest.raises(ValueError, match=r"RELAY_CPU_ONEDNN='yes': expected 1 \(always\), 0 \(never\) or auto"):
        cpu_kernels.override("train_onednn", {"RELAY_CPU_ONEDNN": "yes"})


def test_paired_speedup_is_the_ratio_of_the_best_interleaved_runs(monkeypatch):
    """On a scripted clock: plain costs 3 units, fast 1, except one run disturbed by a busy
    neighbour (plain 30) and one where fast was slowed (2): the best runs ignore both; A and B
    alternate which runs first."""
    now, order = [0.0], []
    costs = iter([3, 1] + [3, 1, 1, 30, 3, 2, 1, 3, 3, 1])  # warm-up pair, then 5 pairs in alternating order
    monkeypatch.setattr(cpu_kernels.time, "perf_counter", lambda: now[0])

    def fn(name):
        def run():
            order.append(name)
            now[0] += next(costs)

        return run

    assert cpu_kernels.paired_speedup(fn("plain"), fn("fast"), pairs=5) == 3.0
    assert order == ["plain", "fast"] + ["plain", "fast", "fast", "plain"] * 2 + ["plain", "fast"]


def test_the_measurement_is_cached_per_machine_and_remeasured_on_request(fresh, monkeypatch):
    runs = []
    monkeypatch.setattr(cpu_kernels, "measure", lambda: runs.append(1) or dict(AVX2_EPYC))
    first = cpu_kernels.measured()
    assert cpu_kernels.measured() == first and len(runs) == 1  # read back, not measured again
    assert first["choices"] == cpu_kernels.decide(AVX2_EPYC) and first["fields"]["torch"] == torch.__version__
    assert list((fresh / "cpu_kernels").glob("*.json")) == [cpu_kernels.cache_file(first["fields"])]
    cpu_kernels.measured(remeasure=True)
    assert len(runs) == 2
    other = torch.get_num_threads()  # another thread count is another machine key
    torch.set_num_threads(other + 1)
    try:
        cpu_kernels.measured()
    finally:
        torch.set_num_threads(other)
    assert len(runs) == 3 and len(list((fresh / "cpu_kernels").glob("*.json"))) == 2


def test_stale_records_are_the_implausible_and_the_busy_ones_on_a_quiet_machine():
    ok = {"speedups": dict(AVX2_EPYC), "load": 0.2}
    assert not cpu_kernels.stale(ok, load_now=0.1) and not cpu_kernels.stale(ok, load_now=3.0)
    busy = {"speedups": dict(AVX2_EPYC), "load": 1.4}
    assert cpu_kernels.stale(busy, load_now=0.3) and not cpu_kernels.stale(
        busy, load_now=1.0
    )  # quiet now: again; still busy: keep
    assert cpu_kernels.stale({"speedups": dict(AVX2_EPYC)}, load_now=0.3)  # a record from before loads were kept
    # this machine's own 2-thread record of 2026-11-25 (measured under a 7-engineer load): decode_fused 24.5x
    seen = {"train_onednn": 1.094, "decode_packed": 0.943, "decode_fused": 24.55}
    assert not cpu_kernels.plausible(seen) and cpu_kernels.plausible(AVX512_EPYC)
    assert cpu_kernels.plausible({"train_onednn": 0.0, "decode_packed": 0.0, "decode_fused": 0.0})  # no oneDNN
    assert cpu_kernels.stale({"speedups": seen, "load": 0.1, "tries": 1}, load_now=3.0)
    assert not cpu_kernels.stale({"speedups": seen, "load": 0.1, "tries": cpu_kernels.RETRIES}, load_now=0.1)


def test_a_disturbed_record_is_measured_again_and_a_busy_one_once_quiet(fresh, monkeypatch):
    """The cache used to keep whatever the first measurement said, forever: a 24.5x from a burst of
    a neighbour's load switched prepacked decoding off on this machine for good."""
    results = [{"train_onednn": 1.09, "decode_packed": 0.94, "decode_fused": 24.5}, dict(AVX2_EPYC), dict(AVX512_EPYC)]
    monkeypatch.setattr(cpu_kernels, "measure", lambda: results.pop(0))
    monkeypatch.setattr(cpu_kernels, "load_per_core", lambda: 1.5)
    first = cpu_kernels.measured()
    assert first["speedups"]["decode_fused"] == 24.5 and first["load"] == 1.5 and first["tries"] == 1
    second = cpu_kernels.measured()  # implausible: measured again, even on the busy machine
    assert second["speedups"] == AVX2_EPYC and second["tries"] == 2
    assert cpu_kernels.measured() == second  # plausible, the machine still busy: kept
    monkeypatch.setattr(cpu_kernels, "load_per_core", lambda: 0.2)
    third = cpu_kernels.measured()  # quiet now: the busy record is replaced
    assert third["speedups"] == AVX512_EPYC and third["load"] == 0.2
    assert cpu_kernels.measured() == third and results == []


def test_an_unwritable_cache_folder_measures_for_the_process(fresh, monkeypatch):
    (fresh / "cpu_kernels").write_text("a file where the folder should be")
    monkeypatch.setattr(cpu_kernels, "measure", lambda: dict(AVX2_EPYC))
    assert cpu_kernels.measured()["choices"] == cpu_kernels.decide(AVX2_EPYC)
    assert cpu_kernels.choice("decode_packed") and not cpu_kernels.choice("train_onednn")


def test_the_engine_follows_the_choice(fresh, monkeypatch, tiny_model_dir):
    """A machine measured like issue 33's AVX2 EPYC: training linears stay torch's, decoding packs
    and fuses; an override wins over the measurement."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(cpu_kernels, "measure", lambda: dict(AVX2_EPYC))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with onednn.onednn_linears(model):
        assert not [m for m in model.modules() if "forward" in m.__dict__]
    fused = []
    real = onednn.packings
    monkeypatch.setattr(onednn, "packings", lambda m, keep=True, fuse=True: fused.append(fuse) or real(m, keep, fuse))
    with onednn.packed_linears(model):
        assert "forward" in model.lm_head.__dict__
    assert fused == [True]
    monkeypatch.setenv("RELAY_CPU_ONEDNN", "1")
    monkeypatch.setenv("RELAY_DECODE_FUSED", "0")
    with onednn.onednn_linears(model):
        assert "forward" in model.lm_head.__dict__
    with onednn.packed_linears(model):
        pass
    assert fused == [True, False]
    monkeypatch.setenv("RELAY_DECODE_PACKED", "0")
    with onednn.packed_linears(model):
        assert "forward" not in model.lm_head.__dict__


def test_packing_a_plain_model_imports_no_peft(monkeypatch, tiny_model_dir):
    """Decoding a model without adapters (chat, serve, a gold table of merged models) packs its
    linears without importing peft, whose import brings bitsandbytes and torch.compile's setup
    (seconds of every such process's start): no module can be a peft layer while peft is not
    imported. With peft imported, a LoRA layer is still recognised and folded."""
    import sys

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    attempts = []

    class Refuse:  # as if peft and bitsandbytes had never been imported: any import of them is seen
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("peft", "bitsandbytes"):
                attempts.append(name)
                raise ImportError(name)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with monkeypatch.context() as hidden:
        for name in [n for n in sys.modules if n.partition(".")[0] in ("peft", "bitsandbytes")]:
            hidden.delitem(sys.modules, name)
        hidden.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
        assert len(onednn.packings(model)) > 0
    assert attempts == []
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    assert any(member.lora for packing in onednn.packings(lora) for member in packing.members)


def test_a_cpu_that_decodes_on_plain_weights_keeps_the_fast_step(fresh, monkeypatch, tiny_model_dir):
    """Measured like this Intel Xeon capped to AVX2 (prepacking 0.98x): no packing, but the
    engine's own step still decodes, and its logits are a plain forward's; RELAY_DECODE_PACKED=0
    keeps the model's own forward (the reference)."""
    from transformers import AutoModelForCausalLM

    from pipeline.modeling import decode

    monkeypatch.setattr(
        cpu_kernels, "measure", lambda: {"train_onednn": 0.83, "decode_packed": 0.98, "decode_fused": 1.12}
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    calls, seen = [], []
    real = decode.FastStep.run
    monkeypatch.setattr(decode.FastStep, "run", lambda self, *a: calls.append(1) or real(self, *a))
    packed = []
    monkeypatch.setattr(onednn, "onednn_linear", lambda *a: packed.append(1) or pytest.fail("a prepacked product ran"))
    prompt = [5, 9, 17, 30]
    out = decode.generate(
        model,
        [prompt],
        max_new_tokens=3,
        eos_ids=[],
        pad_id=0,
        temperature=0.0,
        on_logits=lambda step, logits: seen.append(logits.clone()),
    )
    assert calls and not packed
    with torch.no_grad():
        full = model(torch.tensor([prompt + out.tokens[0]])).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(torch.stack([s[0] for s in seen]), full, atol=1e-5, rtol=0)
    monkeypatch.setenv("RELAY_DECODE_PACKED", "0")
    assert decode.step_kind(model) == "hf"


def test_the_real_measurement_names_every_path(fresh, monkeypatch):
    """The real micro-benchmark on shrunk shapes: a positive speedup per path. It runs where the
    first choice is asked, inside a generate (no autograd there), and must leave the caller's
    random stream as it was: a run that measured and one that read the cache train alike."""
    for name, value in {"LAYERS": 1, "VOCAB": 256, "TRAIN_TOKENS": 16, "HIDDEN": 64, "MLP": 128, "KV": 32}.items():
        monkeypatch.setattr(cpu_kernels, name, value)
    rng = torch.get_rng_state()
    with torch.inference_mode():
        speedups = cpu_kernels.measure()
    assert set(speedups) == set(cpu_kernels.PATHS) and all(v > 0 for v in speedups.values())
    assert torch.equal(torch.get_rng_state(), rng)
