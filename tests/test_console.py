"""The console a stage prints (pipeline/engine/tracking.py): no weight-loading bars or known-harmless
library noise, one line per evaluation, a closing summary with the next commands."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from pipeline.engine.stage_main import main
from pipeline.engine.tracking import format_eval, format_stage_summary, quiet_console
from stages.sft import SFTStage


def test_sft_stage_console(tmp_path, tiny_model_dir, capfd):
    out = tmp_path / "sft"
    argv = [
        "--config",
        "configs/sft.yaml",
        "--model.path",
        str(tiny_model_dir),
        "--output_dir",
        str(out),
        "--train.max_steps",
        "2",
        "--train.eval_steps",
        "2",
        "--train.eval_batches",
        "1",
    ]
    assert main(SFTStage, argv) == 0
    captured = capfd.readouterr()
    text = (captured.out + captured.err).replace("\r", "\n")
    for noise in (
        "Loading weights",
        "Writing model shards",
        "is_gradient_checkpointing",
        "LOAD REPORT",
        "Setting accelerator",
    ):
        assert noise not in text, noise
    assert "eval @ step 2: loss " in text
    summary = captured.out.splitlines()
    assert summary[0].startswith("sft done in ") and summary[0].endswith("(2 steps)")
    assert f"  model: {out}/merged   (figures: {out}/summary.json)" in summary
    assert f"  relay chat --model {out}/merged" in summary


def test_new_reward_head_report_is_dropped_and_kernel_hint_said_once(tmp_path, tiny_model_dir, caplog):
    from transformers import AutoModelForSequenceClassification

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.texts: list[str] = []

        def emit(self, record):
            self.texts.append(record.getMessage())

    keep = Keep()
    library = logging.getLogger("transformers")  # transformers does not propagate to the root logger
    library.addHandler(keep)
    loader = logging.getLogger("transformers.modeling_utils")
    for f in list(loader.filters):  # an earlier quiet_console() in this process: start unfiltered
        loader.removeFilter(f)
    try:
        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
        assert any("LOAD REPORT" in t for t in keep.texts)  # the control: transformers reports the new head
        keep.texts.clear()
        quiet_console()
        AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
        assert not any("LOAD REPORT" in t for t in keep.texts)
    finally:
        library.removeHandler(keep)
    with caplog.at_level(logging.INFO):
        hint = logging.getLogger("bitsandbytes.backends.cpu.ops")
        for _ in range(3):
            hint.warning(
                "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                "`pip install kernels` and the kernels >= 0.11.1",
                "offline",
            )
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "bitsandbytes" in m] == [
        "bitsandbytes: the optional CPU kernel package is unavailable; its built-in 4-bit path is used (harmless)"
    ]


def test_gradient_checkpointing_deprecation_is_silenced():
    quiet_console()
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    assert caught == []


def test_quiet_console_imports_no_transformers_and_its_bars_stay_off_when_it_comes(tmp_path):
    """The driver's `summarize` calls quiet_console and may never load a model: no 1-2 s import of
    transformers for it, and a transformers imported afterwards still shows no progress bars."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from pipeline.engine.tracking import quiet_console; quiet_console(); "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'imported'; "
        "from transformers.utils import logging; assert not logging.is_progress_bar_enabled(), 'bars on'; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "RELAY_VERBOSE")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1]
    )
    assert done.stdout.strip() == "ok", done.stderr[-800:]


def test_format_eval_and_summary():
    assert (
        format_eval({"eval/loss": 1.23456, "eval/loss_task/a": 2.0, "eval/ppl": 48460.0}, 20)
        == "eval @ step 20: loss 1.2346, ppl 4.846e+04"
    )
    text = format_stage_summary(
        "rm", {"eval_accuracy": 0.75, "steps": 3, "wall_seconds": 12.4, "reward_stats": {}}, "out/rm", "reward"
    )
    assert text.splitlines() == [
        "rm done in 12 s (3 steps)",
        "  eval_accuracy 0.7500",
        "  model: out/rm/merged   (figures: out/rm/summary.json)",
        "next:",
        "  relay train configs/ppo.yaml --model.path POLICY --reward_model.path out/rm/merged   # PPO against this RM",
    ]


def test_a_vllm_servers_failure_ends_the_stage_in_one_line(tmp_path, tiny_model_dir, capfd):
    """A vLLM server that dies mid-run (or never starts) ends the stage with one line naming its log
    and the cause (pipeline/modeling/vllm_server.py `VLLMServer.where`) and exit code 1, not a traceback."""
    from pipeline.modeling.vllm_server import VLLMError

    told = "vLLM /v1/completions: HTTP 500: EngineCore died; its log: x.log (last error: RuntimeError: y)"

    class Dying(SFTStage):
        def run(self, *args, **kwargs):
            raise VLLMError(told)

    argv = ["--config", "configs/sft.yaml", "--model.path", str(tiny_model_dir), "--output_dir", str(tmp_path / "o")]
    assert main(Dying, argv) == 1
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1] == f"sft: {told}" and "Traceback" not in err
