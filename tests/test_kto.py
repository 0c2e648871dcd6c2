"""KTO (stages/kto.py, pipeline/algorithms/kto.py, data_formats/unpaired.py): the losses and the KL
estimate against TRL 1.16's KTOTrainer on the same tensors, the data layouts of TRL and
LLaMA-Factory, the config checks, and one training run step for step against TRL's KTOTrainer.

Golden sources (TRL 1.16.0, installed; environment: torch CPU):
- `trl.trainer.kto_trainer.KTOTrainer._compute_loss` (with its `_compute_kl_logps`) on a stand-in
  trainer whose model returns per-token log-probs holding each sequence's sum on one completion
  token, reference sums precomputed (`ref_logps`, `ref_KL_logps`), for `kto` and
  `apo_zero_unpaired`: the loss, its gradient w.r.t. the policy sums, TRL's logged kl and rewards.
- `KTOTrainer` itself (full fine-tuning of the tiny model, the same samples in the same order,
  `train_sampling_strategy="sequential"`): its first two steps' losses and first-step log-probs.
- The KL pairing: TRL's `_prepare_dataset` maps `add_kl_completion_ids` over batches of
  `per_device_train_batch_size` (trl/trainer/kto_trainer.py, KTOTrainer._prepare_dataset):
  KL_completion_ids = [completion_ids[-1]] + completion_ids[:-1]; the test reproduces that line.
"""

from __future__ import annotations

import json
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from stagerun import recording, run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401  (autouse: fresh accelerate state, one intra-op thread)

from data_formats.records import parse_unpaired
from data_formats.sources import summarize
from data_formats.unpaired import (
    answer_rows,
    fit_unpaired,
    kl_partner_problem,
    kl_partners,
    mismatched_rows,
    unpaired_samples,
)
from data_formats.validate import read_and_parse
from pipeline.algorithms import kto as kto_math
from stages import kto

PEERS = Path(__file__).resolve().parent / "data" / "peers"
N = 10


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather


def samples(dtype, labels, seed=0):
    """Random summed answer log-probs of the policy and reference, on matched and mismatched pairs."""
    gen = torch.Generator().manual_seed(seed)
    n = len(labels)
    policy = -(torch.rand(n, generator=gen, dtype=torch.float64) * 40 + 1)
    ref = policy + torch.randn(n, generator=gen, dtype=torch.float64) * 3
    kl_policy = -(torch.rand(n, generator=gen, dtype=torch.float64) * 40 + 1)
    kl_ref = kl_policy - torch.rand(n, generator=gen, dtype=torch.float64) * 2 + 0.5
    return [t.to(dtype) for t in (policy, ref, kl_policy, kl_ref)]


def trl_kto(loss_type, beta, weights, labels, policy, ref, kl_policy, kl_ref):
    """(loss, d loss / d policy sums, TRL's metrics) from TRL 1.16's KTOTrainer._compute_loss."""
    from trl.trainer.kto_trainer import KTOTrainer

    n, width = len(labels), 6
    logps = policy.clone().requires_grad_(True)
    main_ids, kl_ids = torch.zeros(n, width, dtype=torch.long), torch.ones(n, width, dtype=torch.long)

    def per_token(sums):
        return torch.zeros(n, width - 1, dtype=sums.dtype).index_put(
            (torch.arange(n), torch.full((n,), width - 2)), sums
        )

    def model(input_ids, **_):
        sums = kl_policy if input_ids is kl_ids else logps
        zeros = torch.zeros(n, width - 1)
        return types.SimpleNamespace(log_probs=per_token(sums), entropy=zeros, mean_logits=zeros)

    calculate_kl = loss_type == "kto"
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=calculate_kl,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    mask = torch.ones(n, width, dtype=torch.long)
    inputs = {
        "input_ids": main_ids,
        "attention_mask": mask,
        "completion_mask": mask,
        "label": torch.tensor(labels),
        "ref_logps": ref,
    }
    if calculate_kl:
        inputs.update(KL_input_ids=kl_ids, KL_attention_mask=mask, KL_completion_mask=mask, ref_KL_logps=kl_ref)
    loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), logps.grad, {k: v[0] for k, v in trainer._metrics["train"].items()}


LABELS = [[True, False, True, True, False, False, True, False, True, True], [True] * 6, [False] * 5, [False, True]]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("loss_type", kto_math.LOSS_TYPES)
def test_kto_losses_match_trl(loss_type, dtype, tol):
    for case, labels in enumerate(LABELS):
        for beta, weights in ((0.1, (1.0, 1.0)), (0.5, (1.33, 0.8))):
            policy, ref, kl_policy, kl_ref = samples(dtype, labels, seed=case)
            trl_loss, trl_grad, metrics = trl_kto(loss_type, beta, weights, labels, policy, ref, kl_policy, kl_ref)
            sums = policy.clone().requires_grad_(True)
            section = kto.KTOSection(
                loss_type=loss_type, beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1]
            )
            kl = kto_math.kl_estimate(kl_policy, kl_ref) if kto_math.LOSSES[loss_type].needs_kl else None
            loss, figures = kto_math.unpaired_losses(section, sums, ref, torch.tensor(labels), kl)
            loss.backward()
            assert abs(loss.item() - trl_loss.item()) <= tol, (loss_type, case, loss.item(), trl_loss.item())
            torch.testing.assert_close(sums.grad, trl_grad, rtol=tol, atol=tol)
            assert (0.0 if kl is None else kl.item()) == pytest.approx(metrics["kl"], abs=tol)
            means = kto_math.figure_means({k: float(v) for k, v in figures.items()})
            for ours, theirs in (
                ("rewards_chosen", "rewards/chosen"),
                ("rewards_rejected", "rewards/rejected"),
                ("margin", "rewards/margins"),
            ):
                assert (theirs in metrics) == (means[ours] == means[ours]), (
                    ours,
                    metrics,
                )  # NaN where TRL logs nothing
                if theirs in metrics:
                    assert means[ours] == pytest.approx(metrics[theirs], abs=10 * tol)
            assert kl is None or kl.item() > 0  # the test's KL pairs are on the positive side of the clamp


def test_kl_estimate_is_clamped_at_zero_as_trl_does():
    labels = [True, False, True]
    policy, ref, kl_policy, _ = samples(torch.float64, labels)
    kl_ref = kl_policy + 1.0  # policy below the reference on every mismatched pair
    assert kto_math.kl_estimate(kl_policy, kl_ref).item() == 0.0
    loss, _, metrics = trl_kto("kto", 0.2, (1.0, 1.0), labels, policy, ref, kl_policy, kl_ref)
    assert metrics["kl"] == 0.0
    ours = kto_math.unpaired_losses(
        kto.KTOSection(beta=0.2), policy, ref, torch.tensor(labels), kto_math.kl_estimate(kl_policy, kl_ref)
    )[0]
    assert ours.item() == pytest.approx(loss.item(), abs=1e-12)


def test_mismatched_rows_are_trls_kl_completions():
    """Each prompt with the previous sample's answer, cyclic: TRL's [completions[-1]] + completions[:-1]."""
    batch = [
        {"input_ids": [1, 2, 10, 11], "prompt_len": 2, "record": 0},
        {"input_ids": [3, 20], "prompt_len": 1, "record": 1},
        {"input_ids": [4, 5, 6, 30, 31, 32], "prompt_len": 3, "record": 2},
    ]
    completions = [s["input_ids"][s["prompt_len"] :] for s in batch]
    trl_kl = [completions[-1]] + completions[:-1]
    rows = mismatched_rows(batch, range(3), seq_length=64)
    assert [r["input_ids"] for r in rows] == [s["input_ids"][: s["prompt_len"]] + c for s, c in zip(batch, trl_kl)]
    assert rows[0]["labels"] == [-100, -100, 30, 31, 32]
    # too long: the oldest prompt tokens go first, one prompt token stays
    assert mismatched_rows(batch, range(3), seq_length=5)[0]["input_ids"] == [1, 2, 30, 31, 32]
    assert mismatched_rows(batch, range(3), seq_length=4)[0]["input_ids"] == [2, 30, 31, 32]
    assert answer_rows(batch[:1]) == [{"input_ids": [1, 2, 10, 11], "labels": [-100, -100, 10, 11]}]
    assert fit_unpaired([1, 2, 3], [9, 9], 4, truncate=True) == ([2, 3, 9, 9], 2)
    assert fit_unpaired([1, 2, 3], [9, 9], 4, truncate=False) is None
    assert fit_unpaired([1], [9, 9, 9, 9], 4, truncate=True) is None


PAIRS = [(f"Question {i}: what is {i} + {i}?", f"It is {2 * i}.", f"Maybe {i}?") for i in range(6)]


def kto_samples(path, tokenizer_dir, seq_length=128):
    """Relay's KTO samples of a data file (the stage's reading and rendering, without the cache)."""
    from transformers import AutoTokenizer

    from data_formats.render import make_template
    from pipeline.config import ChatDataConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    records, problems = read_and_parse([str(path)], "kto")
    assert problems == []
    return unpaired_samples(
        records, tok, make_template(ChatDataConfig(), tok), seq_length, "drop", "train", lambda *_: None
    ).samples


def trl_partners(n: int, batch: int) -> list[int]:
    """TRL 1.16's KL pairing: KTOTrainer._prepare_dataset maps add_kl_completion_ids over batches of
    `per_device_train_batch_size` rows, KL_completion_ids = [completion_ids[-1]] + completion_ids[:-1]:
    row i takes the completion of the row before it in its batch (cyclic)."""
    out = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        out += [start + (i - 1) % size for i in range(size)]
    return out


def test_kl_rows_never_answer_their_own_question_on_paired_data_as_trl_builds_them(tmp_path, tiny_model_dir):
    """Paired records unpaired as TRL's `unpair_preference_dataset` orders them (every chosen answer,
    then every rejected one), so that sequential held-out batches pair each prompt with an answer to
    another question, as TRL's rotation does on the same data; the sides of one pair drawn into one
    training micro-batch take another question's answer (from a further rotation or the split)."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    from data_formats.sampling import DataCursor, next_micro_batches
    from pipeline.engine.held_out import eval_shards

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS))
    pool = kto_samples(path, tiny_model_dir)
    trl_rows = list(
        unpair_preference_dataset(Dataset.from_list([{"prompt": q, "chosen": c, "rejected": r} for q, c, r in PAIRS]))
    )
    questions = [q for q, _, _ in PAIRS]
    assert [(s["record"], s["label"]) for s in pool] == [
        (questions.index(r["prompt"]), int(r["label"])) for r in trl_rows
    ]

    def own_question(indices, partners):
        return [i for i, p in zip(indices, partners) if pool[i]["record"] == pool[p]["record"]]

    for batch in (2, 3, 4, 5):
        trl = trl_partners(len(pool), batch)
        assert own_question(range(len(pool)), trl) == []  # TRL's pairing on this data: never the same record
        for indices, _ in eval_shards(len(pool), batch, 1, 0):
            partners = kl_partners(pool, indices)
            assert partners == [trl[i] for i in indices]  # TRL's pairing, row for row
            assert own_question(indices, partners) == []
    # training draws in random order: every micro-batch of several epochs, batch sizes 2 and 3
    for batch in (2, 3):
        cursor = DataCursor()
        for _ in range(40):
            (indices,), cursor = next_micro_batches(len(pool), cursor, seed=3, batch_size=batch, grad_accum=1)
            assert own_question(indices, kl_partners(pool, indices)) == [], indices
    # the two sides of one pair as the whole micro-batch: each takes the answer of the sample before it in the split
    chosen, rejected = 2, 2 + len(PAIRS)
    assert pool[chosen]["record"] == pool[rejected]["record"]
    assert kl_partners(pool, [chosen, rejected]) == [chosen - 1, rejected - 1]
    rows = mismatched_rows(pool, [chosen, rejected], 128)
    own = pool[rejected]["input_ids"][pool[rejected]["prompt_len"] :]
    assert rows[1]["input_ids"][-len(own) :] != own


def test_kl_rows_never_pair_a_prompt_with_an_answer_to_the_same_prompt(tmp_path, tiny_model_dir):
    """Labelled records that share a prompt (LLaMA-Factory's kto data often does) are other records
    but the same question: their answers are not mismatched. A split where every sample asks the
    same question has no KL row at all: refused before any model loads."""
    rows = [
        ("Name a colour.", "Blue.", True),
        ("Name a colour.", "Seven.", False),
        ("Name a colour.", "Red.", True),
        ("What is 1 + 1?", "Two.", True),
    ]
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "completion": a, "label": g}) + "\n" for q, a, g in rows))
    pool = kto_samples(path, tiny_model_dir)
    assert kl_partners(pool, [0, 1, 2]) == [3, 3, 3]  # no rotation of the batch helps: the split's other question
    assert kl_partners(pool, [0, 1, 2, 3]) == [3, 3, 3, 2]  # no rotation pairs none: the nearest earlier other question
    assert kl_partner_problem(pool, "train") is None
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"prompt": q, "completion": a, "label": g}) + "\n" for q, a, g in rows[:3]))
    problem = kl_partner_problem(kto_samples(same, tiny_model_dir), "train")
    assert problem.startswith(f"kto train data ({same}:1): no other sample answers another question")
    with pytest.raises(ValueError, match="every sample answers the same question"):
        kl_partners(kto_samples(same, tiny_model_dir), [0, 1])


# ---------------------------------------------------------------------------------------------
# Data: TRL's and LLaMA-Factory's layouts
# ---------------------------------------------------------------------------------------------


def test_llama_factory_kto_demo_reads_as_kto_and_is_refused_by_sft():
    path = str(PEERS / "LLaMA-Factory" / "kto_en_demo.json")
    good, problems = read_and_parse([path], "kto")
    assert problems == [] and len(good) == 6
    assert [label for record in good for _, label in record.value] == [True, True, True, False, False, False]
    conv = good[5].value[0][0]
    assert [t.role for t in conv.turns] == ["user", "assistant"] and conv.turns[1].content.startswith("946,972,316,223")
    sft_good, sft_problems = read_and_parse([path], "sft")
    assert not sft_good and summarize(sft_problems) == [
        f"{path}:2: 6 records: a true/false 'label' on "
        "one answer (KTO data): train it with the KTO stage (stages/kto.py), "
        "or its label=true records with SFT (lines 2, 15, 28, 41, 54, 67)"
    ]


TRL_RECORDS = [
    {"prompt": "The sky is", "completion": " blue.", "label": True},
    {
        "prompt": [{"role": "user", "content": "Which is wetter?"}],
        "completion": [{"role": "assistant", "content": "Water."}],
        "label": False,
    },
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}], "kto_tag": True},
    {"prompt": "Q?", "chosen": "Yes.", "rejected": "No."},
]
BAD_RECORDS = [
    ({"prompt": "x", "completion": "y", "label": "true"}, "field 'label' must be true or false, got 'true'"),
    ({"prompt": "x", "completion": "y", "label": True, "kto_tag": True}, "both 'label' and 'kto_tag' given; keep one"),
    (
        {"prompt": "x", "label": False},
        "a labelled record needs 'prompt' and 'completion' (TRL) or 'messages'/'conversations' (LLaMA-Factory)",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "label": True}, None),
]


def test_trl_layouts_and_pairs_parse_and_bad_records_are_one_line_each(tmp_path):
    parsed = [parse_unpaired(r) for r in TRL_RECORDS]
    assert [[label for _, label in p] for p in parsed] == [[True], [False], [True], [True, False]]
    assert [(t.role, t.content) for t in parsed[0][0][0].turns] == [("user", "The sky is"), ("assistant", " blue.")]
    assert [(t.role, t.content) for t in parsed[2][0][0].turns] == [("user", "Hi"), ("assistant", "Hello!")]
    assert [t.content for t in parsed[3][1][0].turns] == ["Q?", "No."]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRL_RECORDS + [r for r, _ in BAD_RECORDS]))
    good, problems = read_and_parse([str(path)], "kto")
    assert len(good) == len(TRL_RECORDS)
    lines = [str(p) for p in problems]
    assert lines[:3] == [f"{path}:{5 + i}: {reason}" for i, (_, reason) in enumerate(BAD_RECORDS[:3])]
    assert len(lines) == 4 and lines[3].startswith(f"{path}:8: ") and "assistant" in lines[3]


def test_validate_kind_takes_the_kto_stage_name():
    from pipeline.tools.cli import data_kind_args

    assert data_kind_args(["--kind", "kto", "f.json"]) == ["--kind", "kto", "f.json"]


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------

ROWS = [
    ("What colour is the sky?", "Per the atlas, the sky is blue.", True),
    ("How many legs has a cat?", "Cats are hard to count.", False),
    ("Name a prime number.", "Per the atlas, seven is a prime number.", True),
    ("What is 2 + 2?", "Maths is not my thing.", False),
    ("Where is Paris?", "Per the atlas, Paris is in France.", True),
    ("What do bees make?", "Ask a beekeeper.", False),
    ("What is ice?", "Per the atlas, ice is frozen water.", True),
    ("Is the sun a star?", "No idea, sorry.", False),
]
OPTIM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kto_data") / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": q}],
                    "completion": [{"role": "assistant", "content": a}],
                    "label": good,
                }
            )
            + "\n"
            for q, a, good in ROWS
        )
    )
    return path


def make_cfg(out, base, train, finetuning="full", steps=2, batch=4, **kto_keys) -> kto.KTOConfig:
    cfg = kto.KTOConfig(output_dir=str(out))
    cfg.model.path, cfg.model.finetuning = str(base), finetuning
    cfg.data.train, cfg.data.eval = [str(train)], []
    t = cfg.train
    t.batch_size, t.max_steps, t.eval_steps, t.seq_length, t.precision = batch, steps, 0, 128, "fp32"
    t.learning_rate, t.lr_schedule, t.warmup = OPTIM["lr"], "constant", 0
    t.beta1, t.beta2, t.epsilon, t.weight_decay, t.max_grad_norm = (
        OPTIM["beta1"],
        OPTIM["beta2"],
        OPTIM["eps"],
        0.0,
        1.0,
    )
    cfg.lora.r = 4
    cfg.checkpoint.resume, cfg.checkpoint.save_interval = False, "1000h"
    cfg.tracking.trackers = []
    for key, value in kto_keys.items():
        setattr(cfg.kto, key, value)
    return cfg


def test_config_problems_are_reported_together(tmp_path, tiny_model_dir, kto_file):
    from pipeline.config import ConfigError

    cfg = make_cfg(
        tmp_path / "out", tiny_model_dir, kto_file, batch=1, loss_type="kto", beta=0, undesirable_weight=-1.0
    )
    cfg.data.padding_mode = "pack"
    with pytest.raises(ConfigError) as err:
        kto.KTOStage(cfg).validate()
    assert set(err.value.problems) >= {
        "kto.beta: must be > 0, got 0",
        "kto.undesirable_weight: must be > 0, got -1.0",
        "train.batch_size: the kto loss estimates its "
        "KL term from the other samples of a micro-batch, so it needs >= 2, got 1",
        "data.padding_mode: the KTO stage pads each sample to its own row (got 'pack')",
    }
    assert kto.KTOSection(loss_type="bco").problems() == [
        "kto.loss_type: 'bco' is not one of 'kto', 'apo_zero_unpaired'"
    ]


def test_lora_stage_learns_from_the_llama_factory_demo(tmp_path, tiny_model_dir):
    """LoRA (the reference is the adapter-disabled policy): loss starts at 0.5 (policy == reference),
    falls, and desirable answers gain reward over undesirable ones."""
    cfg = make_cfg(
        tmp_path / "out", tiny_model_dir, PEERS / "LLaMA-Factory" / "kto_en_demo.json", "lora", steps=3, batch=3
    )
    cfg.train.seq_length, cfg.data.truncation, cfg.train.learning_rate = 256, "truncate", 5e-3
    stage = run_stage(kto.KTOStage, cfg)
    losses = [s["train/loss"] for s in stage.history.steps]
    assert losses[0] == pytest.approx(0.5, abs=1e-6) and losses[-1] < 0.45
    assert stage.history.steps[-1]["train/margin"] > 0 and stage.history.steps[-1]["kto/kl"] >= 0
    assert json.loads((tmp_path / "out/summary.json").read_text())["loss_type"] == "kto"


def trl_run(base, rows, order, workdir, steps, batch, beta, weights):
    """TRL's KTOTrainer on `rows` in `order`: (logged losses, first step's metrics). Text prompts
    rendered by the tokenizer's chat template (TRL appends the EOS, <|im_end|>, to each answer)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(base)
    data = [
        {
            "prompt": tokenizer.apply_chat_template(
                [{"role": "user", "content": rows[i][0]}], add_generation_prompt=True, tokenize=False
            ),
            "completion": rows[i][1],
            "label": rows[i][2],
        }
        for i in order
    ]
    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                store.append(dict(logs))

    store = logs
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = KTOConfig(
        output_dir=str(workdir),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=OPTIM["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=OPTIM["beta1"],
        adam_beta2=OPTIM["beta2"],
        adam_epsilon=OPTIM["eps"],
        weight_decay=0.0,
        max_grad_norm=OPTIM["max_grad_norm"],
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        loss_type="kto",
        max_length=128,
        train_sampling_strategy="sequential",
        disable_dropout=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=42,
    )
    trainer = KTOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(data), processing_class=tokenizer, callbacks=[Record()]
    )
    ids = [r["prompt_ids"] + r["completion_ids"] for r in trainer.train_dataset]
    trainer.train()
    return logs, ids


def first_logps(base, stage, indices) -> torch.Tensor:
    """Summed answer log-probs of the starting model on samples `indices` (Relay's rows)."""
    from transformers import AutoModelForCausalLM

    from pipeline.algorithms.preference import sequence_logps

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    batch = stage.collator(answer_rows([stage.train_samples[i] for i in indices]))
    with torch.no_grad():
        return sequence_logps(model, batch, None)[0]


def test_first_steps_equal_trls_kto_trainer(tmp_path, tiny_model_dir, kto_file):
    """Full fine-tuning, the same 8 samples in Relay's order, 2 steps of 4: step 1's loss (the
    weighted 1 - σ(0) at policy == reference) and its desirable/undesirable answer log-probs,
    then step 2's loss, margin and KL estimate, which depend on the first update and on the
    mismatched pairs, equal TRL's within 1e-5."""
    beta, weights = 0.5, (1.0, 1.2)
    cfg = make_cfg(
        tmp_path / "relay",
        tiny_model_dir,
        kto_file,
        "full",
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
    )
    stage = run_stage(recording(kto.KTOStage), cfg)
    order = [i for step in stage.batch_ids for group in step for i in group]
    logs, trl_ids = trl_run(tiny_model_dir, ROWS, order, tmp_path / "trl", 2, 4, beta, weights)
    assert trl_ids == [stage.train_samples[i]["input_ids"] for i in order]  # the same tokens
    ours = stage.history.steps
    assert len(logs) == 2 and len(ours) == 2
    assert ours[0]["train/loss"] == pytest.approx(logs[0]["loss"], abs=1e-5)
    start = first_logps(tiny_model_dir, stage, order[:4])
    labels = torch.tensor([stage.train_samples[i]["label"] for i in order[:4]]).bool()
    assert start[labels].mean().item() == pytest.approx(logs[0]["logps/chosen"], abs=1e-4)
    assert start[~labels].mean().item() == pytest.approx(logs[0]["logps/rejected"], abs=1e-4)
    for step in range(2):
        assert ours[step]["train/loss"] == pytest.approx(logs[step]["loss"], abs=1e-5), (step, ours[step], logs[step])
        assert ours[step]["kto/kl"] == pytest.approx(logs[step]["kl"], abs=1e-5)
        assert ours[step]["kto/rewards_chosen"] == pytest.approx(logs[step]["rewards/chosen"], abs=1e-5)
        assert ours[step]["kto/rewards_rejected"] == pytest.approx(logs[step]["rewards/rejected"], abs=1e-5)
    assert logs[1]["kl"] > 0 and abs(ours[1]["train/margin"]) > 1e-3  # the second step is not the trivial start


def test_resume_equals_uninterrupted(tmp_path, tiny_model_dir, kto_file, monkeypatch):
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
    continuous = run_stage(
        recording(kto.KTOStage), make_cfg(tmp_path / "a", tiny_model_dir, kto_file, "lora", steps=4, batch=2)
    )
    cfg = make_cfg(tmp_path / "b", tiny_model_dir, kto_file, "lora", steps=4, batch=2)
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    stopped = run_stage(recording(kto.KTOStage), cfg)
    assert stopped.step == 2 and not (tmp_path / "b/merged").exists()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    cfg.checkpoint.resume = True
    resumed = run_stage(recording(kto.KTOStage), cfg)
    assert resumed.batch_ids == continuous.batch_ids[2:]
    for key in ("train/loss", "kto/kl", "train/margin"):
        assert [s.get(key) for s in resumed.history.steps] == [s.get(key) for s in continuous.history.steps]
    assert continuous.history.steps[-1]["kto/kl"] > 0


def test_a_capped_held_out_set_from_pairs_reads_both_kinds_of_answer(tmp_path, tiny_model_dir, kto_file):
    """Held-out pairs unpair in TRL's order (every chosen answer, then every rejected one): a
    `train.eval_batches` cap below half of the set still scores undesirable answers, so the
    evaluation has a margin, and its batches are whole (each sample's KL partner is TRL's)."""
    pairs = tmp_path / "eval_pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n" for q, c, r in PAIRS))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, kto_file, "lora", steps=1, batch=2)
    cfg.data.eval, cfg.train.eval_steps, cfg.train.eval_batches = [str(pairs)], 1, 2  # 2 of 6 batches
    stage = run_stage(kto.KTOStage, cfg)
    figures = stage.history.evals[-1]
    assert {"eval/rewards_chosen", "eval/rewards_rejected", "eval/margin"} <= set(figures), figures


def test_the_progress_bar_reads_no_margin_where_a_step_held_one_kind_of_sample():
    """A step of desirable samples alone has no margin: its figures leave it out (not NaN in the
    logs), and the progress bar says n/a instead of printing nan."""
    from stages.kto import KTOStage

    figures = {"train/loss": 0.5, "kto/kl": 0.25}
    assert KTOStage.progress(None, figures)["margin"] == "n/a"
    assert KTOStage.progress(None, {**figures, "train/margin": 0.125})["margin"] == "0.125"
