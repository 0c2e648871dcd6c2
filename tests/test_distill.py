"""On-policy distillation: the loss registry against TRL 1.16's own functions (called directly on the
same student/teacher tensors and masks), the top-k teacher form, and the `distill` stage.

Peers: trl 1.16.0, trl/trainer/distillation_trainer.py `_chunked_divergence_loss` (the stable
DistillationTrainer's loss) and trl/experimental/gkd/gkd_trainer.py `GKDTrainer.generalized_jsd_loss`;
verl/trainer/ppo/core_algos.py `kl_penalty_forward` (low_var_kl, reverse_kl_k3's clamps).
Tolerance 1e-6 in fp32.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pipeline.algorithms import distill as dl
from pipeline.engine import supervised_head as sh

V, HS, HT = 50, 16, 24


def _tensors(seed: int = 0):
    """Student/teacher hidden states [B, K, H] (the teacher wider), heads, completion tokens, and
    a ragged mask with a hole (a tool result inside a completion)."""
    g = torch.Generator().manual_seed(seed)
    hs, ht = torch.randn(3, 5, HS, generator=g), torch.randn(3, 5, HT, generator=g)
    ws, wt = torch.randn(V, HS, generator=g) * 0.5, torch.randn(V, HT, generator=g) * 0.5
    tokens = torch.randint(0, V, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    return hs, ht, ws, wt, tokens, mask


def _heads(ws: torch.Tensor, wt: torch.Tensor) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    student = torch.nn.Linear(HS, V, bias=False)
    student.weight = torch.nn.Parameter(ws.clone())
    teacher = torch.nn.Linear(HT, V, bias=False)
    teacher.weight = torch.nn.Parameter(wt.clone(), requires_grad=False)
    return student, teacher


def _relay(loss_type: str, hs, ht, ws, wt, tokens, mask, beta: float, temperature: float, top_k: int = 0):
    """Relay's loss and its gradients (hidden, head weight), in chunks of 2 rows."""
    h = hs.clone().requires_grad_(True)
    student, teacher = _heads(ws, wt)
    keep = mask.bool()
    per = dl.per_token_losses(
        loss_type,
        h[keep],
        student,
        dl.Teacher(ht[keep], teacher, top_k),
        tokens[keep],
        beta=beta,
        temperature=temperature,
    )
    loss = dl.global_token_loss(per, keep.sum())
    loss.backward()
    return loss.detach(), h.grad, student.weight.grad


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Two rows per chunk, so every test crosses chunk borders."""
    monkeypatch.setattr(dl, "chunked_rows", functools.partial(sh.chunked_rows, chunk=2))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_equals_trl_chunked_divergence(beta, temperature):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    hs, ht, ws, wt, tokens, mask = _tensors()
    loss, grad_h, grad_w = _relay("jsd", hs, ht, ws, wt, tokens, mask, beta, temperature)
    h, w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    ref, _, _ = _chunked_divergence_loss(
        h, ht, w, wt, mask, beta, num_items_in_batch=mask.sum(), temperature=temperature
    )
    ref.backward()
    assert torch.allclose(loss, ref.detach(), atol=1e-6, rtol=0), (float(loss), float(ref))
    assert torch.allclose(grad_h, h.grad, atol=1e-6, rtol=0)
    assert torch.allclose(grad_w, w.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_equals_gkd_generalized_jsd(beta, temperature):
    from trl.experimental.gkd import GKDTrainer

    hs, ht, ws, wt, tokens, mask = _tensors(1)
    loss, grad_h, grad_w = _relay("jsd", hs, ht, ws, wt, tokens, mask, beta, temperature)
    h, w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    labels = tokens.masked_fill(mask == 0, -100)
    ref = GKDTrainer.generalized_jsd_loss(
        h @ w.T, ht @ wt.T, labels=labels, beta=beta, temperature=temperature, num_items_in_batch=mask.sum()
    )
    ref.backward()
    assert torch.allclose(loss, ref.detach(), atol=1e-6, rtol=0), (float(loss), float(ref))
    assert torch.allclose(grad_h, h.grad, atol=1e-6, rtol=0)
    assert torch.allclose(grad_w, w.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_at_full_vocabulary_is_the_full_form(beta):
    hs, ht, ws, wt, tokens, mask = _tensors(2)
    full = _relay("jsd", hs, ht, ws, wt, tokens, mask, beta, 0.7)
    topk = _relay("jsd", hs, ht, ws, wt, tokens, mask, beta, 0.7, top_k=V)
    for a, b in zip(full, topk):
        assert torch.isfinite(b).all()
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    # a smaller support is another objective (the negative control), still finite
    part = _relay("jsd", hs, ht, ws, wt, tokens, mask, beta, 0.7, top_k=5)
    assert torch.isfinite(part[1]).all() and not torch.allclose(full[0], part[0], atol=1e-4)


@pytest.mark.parametrize("loss_type,estimator", [("reverse_kl_k1", dl.k1), ("reverse_kl_k3", dl.k3)])
def test_reverse_kl_reward_form(loss_type, estimator):
    """Its value is the per-token KL estimate of the sampled tokens; its gradient the policy
    gradient of the per-token reward -k (k held fixed) through log p_s of the sampled token."""
    hs, ht, ws, wt, tokens, mask = _tensors(3)
    hs, ht = hs * 0.3, ht * 0.3  # flatter distributions: k3 = exp(r) - 1 - r stays O(1), as in training
    loss, grad_h, grad_w = _relay(loss_type, hs, ht, ws, wt, tokens, mask, 0.5, 0.7)
    keep = mask.bool()
    h, w = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    own = torch.log_softmax(h[keep] @ w.T / 0.7, -1).gather(-1, tokens[keep, None]).squeeze(-1)
    target = torch.log_softmax(ht[keep] @ wt.T / 0.7, -1).gather(-1, tokens[keep, None]).squeeze(-1)
    k = estimator(own, target).detach()
    assert torch.allclose(loss, k.sum() / keep.sum(), atol=1e-6, rtol=1e-6)
    (k * own).sum().div(keep.sum()).backward()
    assert torch.allclose(grad_h, h.grad, atol=1e-6, rtol=1e-6)
    assert torch.allclose(grad_w, w.grad, atol=1e-6, rtol=1e-6)
    assert dl.LOSSES[loss_type].on_policy_only


def test_k3_has_verls_clamps():
    """verl's low_var_kl (verl/trainer/ppo/core_algos.py `kl_penalty_forward`): r = log p_t - log p_s
    clamped to [-20, 20], exp(r) - r - 1 clamped to [-10, 10]. Golden values by hand: r = 11.9 gives
    e^11.9 - 12.9 = 1.47e5 -> 10; r = 24.99 -> 20 -> 10; r = -29.99 -> -20: e^-20 + 19 -> 10;
    r = 1: e - 2; r = -0.2: e^-0.2 - 0.8. The loss's gradient is the clamped estimate times
    grad log p_s (the reward is the clamped one)."""
    student = torch.tensor([-12.0, -25.0, -0.01, -3.0, -0.5], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-0.1, -0.01, -30.0, -2.0, -0.7], dtype=torch.float64)
    want = torch.tensor([10.0, 10.0, 10.0, math.e - 2, math.exp(-0.2) - 0.8], dtype=torch.float64)
    torch.testing.assert_close(dl.k3(student.detach(), teacher), want, rtol=1e-12, atol=1e-12)
    dl.reward_form(dl.k3(student, teacher), student).sum().backward()
    torch.testing.assert_close(student.grad, want, rtol=1e-12, atol=1e-12)


def test_chunked_rows_never_builds_all_logits(monkeypatch):
    """The head runs on at most `chunk` rows at a time, forward and backward."""
    seen = []
    linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return linear(x, w, b)

    hs, ht, ws, wt, tokens, mask = _tensors()
    monkeypatch.setattr(sh.F, "linear", spy)
    _relay("jsd", hs, ht, ws, wt, tokens, mask, 0.5, 1.0)
    assert seen and max(seen) <= 2


# ------------------------------------------------------------------------------------------
# The stage (tiny random models; the teacher another seed of the same shape and tokenizer)
# ------------------------------------------------------------------------------------------

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from stagerun import fresh_accelerate, recording, run_stage  # noqa: E402

from pipeline.config import ConfigError, load_config  # noqa: E402


@pytest.fixture
def fresh_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fresh_accelerate()
    yield
    fresh_accelerate()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from tinymodels import make_tiny_model

    # wider than the student and sharper (a larger init scale): a teacher worth learning from
    return make_tiny_model(
        tmp_path_factory.mktemp("teacher") / "model",
        seed=7,
        hidden_size=96,
        intermediate_size=192,
        initializer_range=0.2,
    )


def _data(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    prompts, sft = folder / "prompts.jsonl", folder / "sft.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(8)))
    sft.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"add {i} and {i}"},
                        {"role": "assistant", "content": f"{2 * i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    return prompts, sft


def _args(model, teacher, data: Path, out: Path, *extra) -> list[str]:
    prompts, sft = _data(data)
    return [
        "--model.path",
        str(model),
        "--teacher.path",
        str(teacher),
        "--data.train",
        f"[{prompts}]",
        "--data.eval",
        "[]",
        "--data.completions",
        f"[{sft}]",
        "--output_dir",
        str(out),
        "--train.seq_length",
        "64",
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "2",
        "--train.learning_rate",
        "5e-3",
        "--train.warmup",
        "0",
        "--train.log_steps",
        "1",
        "--train.eval_steps",
        "0",
        "--generation.max_new_tokens",
        "6",
        "--checkpoint.save_interval",
        "1000h",
        *extra,
    ]


def _run(argv):
    from stages.distill import DistillStage

    return run_stage(recording(DistillStage), argv)


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_resume_equals_unbroken_and_the_manifest_names_the_teacher(
    adapter, tiny_model_dir, teacher_dir, tmp_path, monkeypatch, fresh_state
):
    """lmbda 0.5: on-policy and off-policy steps both run; a run stopped after step 2 and resumed
    trains as an unbroken one (the prompt cursor, the completion sampler and the student's RNG)."""
    common = ["--train.max_steps", "4", "--distill.lmbda", "0.5", "--model.finetuning", adapter]
    full = _run(_args(tiny_model_dir, teacher_dir, tmp_path / "data", tmp_path / "full", *common))
    steps = full.history.steps
    assert {r["distill/on_policy"] for r in steps} == {0.0, 1.0}
    assert all(r["distill/kl"] > 0 and r["train/loss"] > 0 for r in steps)
    assert not any("rollout/logprob_diff_max" in r for r in steps)  # Relay's engine reports no log-probs of its own
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    first = _run(_args(tiny_model_dir, teacher_dir, tmp_path / "data", tmp_path / "cut", *common))
    assert first.step == 2
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    second = _run(_args(tiny_model_dir, teacher_dir, tmp_path / "data", tmp_path / "cut", *common))
    assert [r["step"] for r in second.history.steps] == [1, 2, 3, 4]
    for want, got in zip(steps[2:], second.history.steps[2:]):
        for tag in ("train/loss", "train/grad_norm", "distill/kl", "distill/on_policy", "distill/completion_length"):
            assert got[tag] == want[tag], tag
    assert second.batch_ids == full.batch_ids[len(first.batch_ids) :]
    manifest = json.loads((tmp_path / "cut" / "merged" / "manifest.json").read_text())
    assert manifest["teacher"]["path"] == str(teacher_dir) and manifest["teacher"]["weights_hash"]


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_before_any_model_loads(
    tiny_model_dir, teacher_dir, tmp_path, monkeypatch, fresh_state
):
    from transformers import AutoTokenizer

    from stages import distill as stage

    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(other)
    monkeypatch.setattr(stage, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    cfg = load_config(stage.DistillConfig, _args(tiny_model_dir, other, tmp_path / "data", tmp_path / "o"))
    with pytest.raises(ConfigError) as err:
        stage.DistillStage(cfg).run()
    lines = [p for p in err.value.problems if p.startswith("teacher.path")]
    assert len(lines) == 1 and str(tiny_model_dir) in lines[0] and str(other) in lines[0], err.value.problems


def test_config_refusals(tiny_model_dir, teacher_dir, tmp_path, fresh_state):
    from stages import distill as stage

    with pytest.raises(ConfigError) as err:
        load_config(
            stage.DistillConfig,
            _args(
                tiny_model_dir,
                teacher_dir,
                tmp_path / "data",
                tmp_path / "o",
                "--distill.loss_type",
                "reverse_kl_k3",
                "--distill.lmbda",
                "0.5",
                "--distill.beta",
                "0.2",
                "--teacher.top_k",
                "4",
            ),
        )
    found = err.value.problems
    assert any(p.startswith("distill.lmbda: the reverse_kl_k3 loss") for p in found)
    assert any(p.startswith("distill.beta: only the jsd loss") for p in found)
    assert any(p.startswith("teacher.top_k: only the jsd loss") for p in found)


def test_a_served_teacher_takes_a_colocated_share_of_the_gpu(tiny_model_dir, teacher_dir, tmp_path, monkeypatch):
    """The teacher's server runs on the trainer's GPU: it is started with
    teacher.vllm_gpu_memory_utilization (TRL's colocated 0.3 by default; vLLM's own 0.9 would leave
    the trainer nothing), on a CPU without it; out of range, or set for an in-process teacher, the
    option is refused in one line."""
    from pipeline.modeling import vllm_server
    from stages import distill as stage

    monkeypatch.setattr(vllm_server, "vllm_python", lambda: "python")
    common = _args(tiny_model_dir, teacher_dir, tmp_path / "data", tmp_path / "o", "--teacher.top_k", "4")
    cfg = load_config(stage.DistillConfig, [*common, "--teacher.backend", "vllm"])
    for gpu, share in ((True, "0.3"), (False, None)):
        monkeypatch.setattr(vllm_server, "on_gpu", lambda: gpu)
        cmd = vllm_server.server_command("python", "/m", "127.0.0.1", 8000, stage.teacher_server_options(cfg))
        got = cmd[cmd.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in cmd else None
        assert got == share, (gpu, cmd)
    for backend, value, line in (
        ("vllm", "1.5", "teacher.vllm_gpu_memory_utilization: must be in (0, 1], got 1.5"),
        (
            "relay",
            "0.5",
            "teacher.vllm_gpu_memory_utilization: only teacher.backend vllm reads it (teacher.backend is 'relay')",
        ),
    ):
        extra = ["--teacher.backend", backend, "--teacher.vllm_gpu_memory_utilization", value]
        with pytest.raises(ConfigError) as err:
            load_config(stage.DistillConfig, [*common, *extra])
        assert line in err.value.problems, err.value.problems


def test_a_loss_entry_says_whether_it_reads_the_teachers_top_k(tiny_model_dir, teacher_dir, tmp_path, monkeypatch):
    """teacher.top_k is checked against the entry's reads_top_k, not against a loss name."""
    from pipeline.algorithms import distill as dl
    from stages import distill as stage

    made_up = dl.LOSSES["jsd"]._replace(options=())
    monkeypatch.setitem(dl.LOSSES, "made_up", made_up)
    args = _args(tiny_model_dir, teacher_dir, tmp_path / "data", tmp_path / "o", "--teacher.top_k", "4")
    cfg = load_config(stage.DistillConfig, [*args, "--distill.loss_type", "made_up"])
    assert not [p for p in cfg.problems() if p.startswith("teacher.top_k")]
    monkeypatch.setitem(dl.LOSSES, "made_up", made_up._replace(reads_top_k=False))
    with pytest.raises(ConfigError) as err:
        load_config(stage.DistillConfig, [*args, "--distill.loss_type", "made_up"])
    assert [p for p in err.value.problems if p.startswith("teacher.top_k")] == [
        "teacher.top_k: only the jsd loss reads the teacher's top-k (loss_type is 'made_up')"
    ]


class _Scripted:
    """A sampler that answers each prompt (by its ids) with a fixed completion."""

    def __init__(self, answers: dict):
        self.answers = answers

    def generate(self, prompts, *, max_new_tokens=None):
        return [list(self.answers[tuple(p)]) for p in prompts]


def test_two_steps_equal_trl_distillation_trainer(tiny_model_dir, teacher_dir, tmp_path, monkeypatch, fresh_state):
    """The first two losses of the stage equal TRL 1.16's DistillationTrainer on the same student,
    teacher, prompts and completions (both samplers replaced by the same fixed completions, one
    ragged), full fine-tuning, AdamW, constant LR, clipping at 1.0; fp32 on the default kernels."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    from stages.distill import DistillStage

    monkeypatch.setenv("RELAY_CPU_ONEDNN", "0")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["count to 1", "count to 2"]
    prompt_ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    prompt_ids = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompt_ids]
    assert len(prompt_ids[0]) == len(prompt_ids[1])  # no left padding: TRL passes no position ids
    completions = [
        tok.encode("one two three", add_special_tokens=False) + [tok.eos_token_id],
        tok.encode("four", add_special_tokens=False) + [tok.eos_token_id],
    ]
    answers = {tuple(p): c for p, c in zip(prompt_ids, completions)}

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    argv = [
        "--model.path",
        str(tiny_model_dir),
        "--model.finetuning",
        "full",
        "--teacher.path",
        str(teacher_dir),
        "--data.train",
        f"[{prompts}]",
        "--data.eval",
        "[]",
        "--output_dir",
        str(tmp_path / "relay"),
        "--train.seq_length",
        "64",
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "1",
        "--train.max_steps",
        "2",
        "--train.learning_rate",
        "5e-3",
        "--train.lr_schedule",
        "constant",
        "--train.warmup",
        "0",
        "--train.max_grad_norm",
        "1.0",
        "--train.beta2",
        "0.999",
        "--train.eval_steps",
        "0",
        "--train.log_steps",
        "1",
        "--generation.max_new_tokens",
        "6",
        "--distill.beta",
        "0.5",
        "--checkpoint.save_interval",
        "1000h",
    ]
    stage = run_stage(DistillStage, argv, generator_factory=lambda policy: _Scripted(answers))
    relay = [r["train/loss"] for r in stage.history.steps]

    seen = []

    def scripted(self, ids, images, multimodal_fields, has_tool_images=False):
        seen.extend(tuple(p) for p in ids)
        return [list(answers[tuple(p)]) for p in ids]

    monkeypatch.setattr(DistillationTrainer, "_generate_single_turn", scripted)
    args = DistillationConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.5,
        temperature=1.0,
        max_completion_length=6,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        weight_decay=0.0,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    trainer = DistillationTrainer(
        model=str(tiny_model_dir),
        teacher_model=str(teacher_dir),
        args=args,
        train_dataset=dataset,
        processing_class=tok,
    )
    losses = []
    compute = trainer.compute_loss

    def recorded(*a, **k):
        out = compute(*a, **k)
        losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
        return out

    trainer.compute_loss = recorded
    trainer.train()
    assert set(seen) == set(answers)
    assert len(losses) == 2 and len(relay) == 2
    assert abs(relay[0] - losses[0]) < 1e-6 and abs(relay[1] - losses[1]) < 1e-6, (relay, losses)
    assert relay[1] != relay[0]
