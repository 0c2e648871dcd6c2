"""On-policy distillation stage: a student learns a frozen teacher's next-token distribution on its
own samples.

    torchrun --nproc_per_node 1 stages/distill.py --config configs/distill.yaml [--teacher.path outputs/ppo/merged]

Each step (`DistillStage.train_step`) is on-policy with probability `distill.lmbda` (GKD's share of
batches the student samples; the draw is seeded by train.seed and the step, so a resumed run makes
the same draws): a batch of prompts is sampled by the student with the generation backends PPO and
GRPO use (relay, hf, vllm: pipeline/rl/rollout.py), else a batch of the dataset's own
completions (`data.completions`, SFT conversations; every assistant turn is scored). The teacher
(`teacher.path`, a model folder with the student's tokenizer, loaded frozen in its own dtype) scores
the same ids and the loss is `distill.loss_type` of pipeline/algorithms/distill.py: TRL 1.16's
generalized JSD (`beta`, `temperature`, token-level over the global batch), over the teacher's
top-k plus a tail bucket with `teacher.top_k`, or the reverse KL as a per-token reward (k1/k3). Both
models' logits are formed a chunk of rows at a time (pipeline/engine/supervised_head.py).

Resume is the engine's (adapters or full weights, optimizer, scheduler, RNG, the prompt cursor) plus
the completion sampler's position (`state_dict`), so a restarted run trains as an unbroken one. The
run's identity covers the teacher's weights (`input_models`) and, with lmbda < 1, data.completions'
files (`training_data`): a resume after either changed is refused unless checkpoint.resume_changed,
and the pipeline calls a finished run stale. merged/'s manifest names the teacher (path and weights
hash) and the data keys its `data_digest` covers.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from data_formats.datasets import build_sft_data
from data_formats.validate import data_problems
from pipeline.algorithms import distill as dl
from pipeline.algorithms.mismatch import logprob_diff
from pipeline.config import GenerationConfig, ModelConfig, PromptDataConfig, StageConfig
from pipeline.config.backends import unread_options
from pipeline.config.policy import sampling_engine_problems
from pipeline.config.sections import STAGE_REF
from pipeline.engine.checkpoint import seeded_fork
from pipeline.engine.held_out import ratio
from pipeline.engine.resume import launched_world_size
from pipeline.engine.stage import Stage
from pipeline.engine.stage_main import main
from pipeline.engine.supervised_head import chunked_rows, head_split, hidden_forward
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.handoff import fact_problems, folder_facts
from pipeline.modeling.manifest import tokenizer_length, weights_hash
from pipeline.modeling.models import load_model, remote_code_problems, train_without_dropout
from pipeline.modeling.preflight import folder_problems, model_problems
from pipeline.modeling.scoring import position_ids_from_mask
from pipeline.modeling.vllm_server import ServerOptions, VLLMServer, prompt_topk, vllm_python
from pipeline.rl.policy_stage import GeneratorFactory, PolicyStage, frozen
from pipeline.rl.rollout import ActorCritic, Rollout, assemble_masked

# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class DistillData(PromptDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/ppo/train.jsonl"])
    """Prompts the student samples on on-policy steps (any prompt format PPO and GRPO read)."""
    eval: list[str] = field(default_factory=list)
    """Held-out prompts for `eval/kl` (one sampled completion each). None by default
    (data.eval_fraction carves them off `train`)."""
    completions: list[str] = field(default_factory=list)
    """SFT conversations for the off-policy steps (the share 1 - distill.lmbda): the dataset's own
    answers, every assistant turn scored against the teacher. Needed when lmbda < 1."""


@dataclass
class TeacherConfig(ModelConfig):
    """The frozen teacher: loaded in process in its own dtype without gradients, or served by vLLM.
    Its `finetuning` and `gradient_checkpointing` are not read."""

    path: str = ""
    """Required: a model folder sharing the student's tokenizer (a chain's RL model, a larger model)."""
    top_k: int = 0
    """> 0: the loss reads the teacher's top-k log-probs and one tail bucket (what a served teacher
    returns); 0: its whole distribution."""
    backend: str = "relay"
    """Who scores: relay (the teacher in this process, beside the student) or vllm (a vLLM server
    on `path` answers each sequence's top-k prompt log-probs, so the teacher is not in the trainer's
    memory; needs top_k > 0 and distill.temperature 1)."""
    vllm_gpu_memory_utilization: float = 0.3
    """backend vllm on a GPU: the share of GPU memory the teacher's server may take; it runs on the
    trainer's GPU (beside the student's own server when generation.backend is vllm), so the default
    is TRL's for a colocated engine, not vLLM's 0.9. Not passed on a CPU."""


def teacher_server_options(cfg: "DistillConfig") -> ServerOptions:
    """The served teacher's server: the sequence and its next token in context, its top-k prompt
    log-probs, and on a GPU (the trainer's) `teacher.vllm_gpu_memory_utilization` of its memory."""
    return ServerOptions(
        name="teacher",
        max_model_len=cfg.train.seq_length + 1,
        gpu_memory_utilization=cfg.teacher.vllm_gpu_memory_utilization,
        extra=["--max-logprobs", str(max(20, cfg.teacher.top_k))],
    )


def _served_problems(cfg: "DistillConfig") -> list[str]:
    out = []
    if not 0 < cfg.teacher.vllm_gpu_memory_utilization <= 1:
        out.append(
            f"teacher.vllm_gpu_memory_utilization: must be in (0, 1], got {cfg.teacher.vllm_gpu_memory_utilization}"
        )
    if cfg.teacher.top_k <= 0:
        out.append("teacher.top_k: a served teacher reports its top-k log-probs; set it (e.g. 20)")
    if cfg.distill.temperature != 1.0:
        out.append(
            f"distill.temperature: {cfg.distill.temperature} with teacher.backend vllm, whose log-probs are at "
            "temperature 1 (its top-k cannot be rescaled); use 1 or the relay backend"
        )
    if vllm_python() is None:
        out.append("teacher.backend: vllm is not installed (bash run_scripts/install_vllm.sh)")
    return out


@dataclass(frozen=True)
class TeacherBackend:
    """A way to score the student's tokens with the teacher: in this process, or on a server."""

    in_process: bool
    problems: Callable[["DistillConfig"], list[str]] = lambda cfg: []
    doc: str = ""
    options: tuple[str, ...] = ()
    """The `teacher.*` options only this backend reads (another backend refuses them set)."""


TEACHER_BACKENDS: dict[str, TeacherBackend] = {
    "relay": TeacherBackend(True, doc="the frozen teacher beside the student"),
    "vllm": TeacherBackend(
        False,
        _served_problems,
        doc="top-k prompt log-probs from a vLLM server",
        options=("vllm_gpu_memory_utilization",),
    ),
}
"""`teacher.backend` -> its entry."""


@dataclass
class DistillSection:
    """TRL's DistillationConfig / GKDConfig names."""

    loss_type: str = "jsd"
    """pipeline/algorithms/distill.py's LOSSES: jsd | reverse_kl_k1 | reverse_kl_k3."""
    beta: float = 0.5
    """jsd: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the generalized JSD."""
    temperature: float = 1.0
    """Both distributions' temperature in the loss (TRL's `temperature`; sampling reads generation.temperature)."""
    lmbda: float = 1.0
    """The share of steps on the student's own samples (GKD's lmbda); the rest on data.completions."""

    def problems(self, key: str = "distill") -> list[str]:
        out = []
        spec = dl.LOSSES.get(self.loss_type)
        if spec is None:
            out.append(f"{key}.loss_type: {self.loss_type!r} is not one of {', '.join(map(repr, dl.LOSS_TYPES))}")
        if not 0.0 <= self.beta <= 1.0:
            out.append(f"{key}.beta: must be in [0, 1], got {self.beta}")
        if not self.temperature > 0:
            out.append(f"{key}.temperature: must be > 0, got {self.temperature}")
        if not 0.0 <= self.lmbda <= 1.0:
            out.append(f"{key}.lmbda: must be in [0, 1], got {self.lmbda}")
        if spec is not None and self.beta != DistillSection.beta and "beta" not in spec.options:
            out.append(
                f"{key}.beta: only the {', '.join(n for n, s in dl.LOSSES.items() if 'beta' in s.options)} loss "
                f"reads it (loss_type is {self.loss_type!r})"
            )
        if spec is not None and spec.on_policy_only and self.lmbda != 1.0:
            out.append(f"{key}.lmbda: the {self.loss_type} loss scores the student's own samples only (set lmbda: 1)")
        return out


@dataclass
class DistillConfig(StageConfig):
    output_dir: str = "outputs/distill"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the student), summary.json."""
    data: DistillData = field(default_factory=DistillData)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    distill: DistillSection = field(default_factory=DistillSection)

    def problems(self) -> list[str]:
        out = super().problems() + sampling_engine_problems(self.generation, self.distributed, tools=False)
        backend = TEACHER_BACKENDS.get(self.teacher.backend)
        if backend is None:
            out.append(
                f"teacher.backend: {self.teacher.backend!r} is not one of {', '.join(map(repr, TEACHER_BACKENDS))}"
            )
        else:
            out += backend.problems(self)
            out += unread_options(self.teacher, TEACHER_BACKENDS, self.teacher.backend, "teacher", "backend")
        if not self.teacher.path:
            out.append("teacher.path: required (a model folder sharing the student's tokenizer)")
        elif self.teacher.path.startswith(STAGE_REF):
            out.append(
                f"teacher.path: {self.teacher.path!r} names a chain stage's model, which only `relay pipeline` "
                "resolves; a stage run alone needs a model folder"
            )
        if self.teacher.top_k < 0:
            out.append(f"teacher.top_k: must be >= 0, got {self.teacher.top_k}")
        spec = dl.LOSSES.get(self.distill.loss_type)
        if self.teacher.top_k and spec is not None and not spec.reads_top_k:
            readers = ", ".join(name for name, entry in dl.LOSSES.items() if entry.reads_top_k)
            out.append(
                f"teacher.top_k: only the {readers} loss reads the teacher's top-k "
                f"(loss_type is {self.distill.loss_type!r})"
            )
        if self.distill.lmbda < 1.0 and not self.data.completions:
            out.append("data.completions: distill.lmbda < 1 trains that share of steps on SFT conversations; name them")
        if self.train.batch_size % self.train.grad_accum:
            out.append(
                f"train.grad_accum: {self.train.grad_accum} does not divide train.batch_size {self.train.batch_size}"
            )
        return (
            out
            + data_problems(self.data.completions, "data.completions")
            + self.generation.room_problems(self.train.seq_length)
        )


def teacher_problems(teacher: TeacherConfig, teacher_path: str, student_path: str) -> list[str]:
    """What keeps `teacher` (resolved to `teacher_path`) from scoring the student's ids, one line each:
    the model-folder checks model.path gets (pipeline.modeling.preflight: no folder, a LoRA adapter,
    a reward model, pickled weights without teacher.allow_pickle, no tokenizer; custom code without
    teacher.trust_remote_code), then, for a sound folder, whether it tokenises as the student (a
    student folder that is not sound has its own model.path line).

    The loss compares the two next-token distributions row for row, so both heads must have the same
    number of rows (config.json's vocab_size) as well as the same tokenizer: TRL 1.16's
    DistillationTrainer and GKDTrainer refuse another vocab_size for the same reason. The padded
    rows past the tokenizer's length are left in (not sliced off): the student samples from, and
    learns, its whole distribution."""
    found = model_problems(teacher_path, "teacher.path", need="causal", allow_pickle=teacher.allow_pickle)
    if found:
        return found
    if not Path(teacher_path).is_dir():
        return [f"teacher.path: {teacher_path!r} is not a model folder (its tokenizer is compared with the student's)"]
    found = remote_code_problems(dataclasses.replace(teacher, path=teacher_path), "teacher")
    if found or not Path(student_path).is_dir() or folder_problems(Path(student_path), "model.path", "any", True):
        return found
    student, taught = folder_facts(student_path), folder_facts(teacher_path)
    names = f"the student {student_path} and the teacher {teacher_path}"
    if student["tokenizer_hash"] != taught["tokenizer_hash"]:
        found = [p for p in fact_problems("student", student, "teacher", taught) if not p.startswith("chat template")]
        return [f"teacher.path: {names} do not share a tokenizer ({'; '.join(found)})"]
    if student["vocab_size"] != taught["vocab_size"]:
        return [
            f"teacher.path: {names} share a tokenizer ({tokenizer_length(student_path)} tokens) but not the number "
            f"of embedding rows (config.json vocab_size: the student has {student['vocab_size']}, the teacher "
            f"{taught['vocab_size']}; the rows past the tokenizer's are padding): the loss compares the two "
            "next-token distributions row for row, so they need one vocab_size"
        ]
    return []


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class Student(ActorCritic):
    """The student (no critic) as accelerate wraps it: its forward returns the rows the loss reads,
    so the engine's wrapper (DDP's gradient hooks, FSDP's gathers) sees the forward."""

    def forward(self, head: Optional[torch.nn.Linear] = None, **inputs) -> torch.Tensor:
        """The final hidden states under `head` (the chunked head's rows), else the logits."""
        return hidden_forward(self.policy, head, **inputs) if head is not None else self.policy(**inputs).logits


class DistillStage(PolicyStage):
    name = "distill"
    config_class = DistillConfig
    reward_model_required = False

    def __init__(
        self,
        cfg: DistillConfig,
        *,
        generator_factory: Optional[GeneratorFactory] = None,
        teacher_server: Optional[VLLMServer] = None,
    ):
        """`generator_factory(policy)` swaps the sampler (as PPO's and GRPO's); `teacher_server`, a
        running server on teacher.path, is used instead of starting one (teacher.backend vllm)."""
        Stage.__init__(self, cfg)  # PolicyStage's reads a reward model, which distillation has none of
        self.reward_path = None
        self.generator_factory = generator_factory
        self._generator = None
        self.tools: dict = {}
        self.teacher_path = resolve_model_path(cfg.teacher.path) if cfg.teacher.path else ""
        self.teacher: Optional[torch.nn.Module] = None
        """The in-process teacher (None: served)."""
        self.teacher_server = teacher_server
        self.own_server = False
        self.completions: list[dict] = []
        self.completion_cursor = {"epoch": 0, "position": 0}
        """Where the off-policy steps are in their seeded shuffle of data.completions (rides in checkpoints)."""

    def problems(self) -> list[str]:
        found = super().problems()
        found += teacher_problems(self.cfg.teacher, self.teacher_path, self.model_path) if self.teacher_path else []
        backend = TEACHER_BACKENDS.get(self.cfg.teacher.backend)
        if backend is not None and not backend.in_process and launched_world_size() > 1:
            found.append(
                f"teacher.backend: {self.cfg.teacher.backend} with more than one rank is refused (every rank would "
                "start its own server); run one process, or use backend relay"
            )
        return found

    def build_data(self) -> list[str]:
        """Prompts (and eval prompts) as PPO's; data.completions' SFT conversations when lmbda < 1."""
        problems = self.build_prompts()
        cfg = self.cfg
        if cfg.distill.lmbda < 1.0:
            section = dataclasses.replace(cfg.data, train=list(cfg.data.completions), eval=[], eval_fraction=0.0)
            self.completions = build_sft_data(
                section, self.tokenizer, self.template, cfg.train.seq_length, "train"
            ).samples
            problems += self.fill_problems(len(self.completions), "usable completion(s)", "off-policy batch")
        return problems

    def build_model(self) -> torch.nn.Module:
        """The student (LoRA or full), and the frozen teacher beside it, out of the trained module."""
        cfg = self.cfg
        student = load_model(cfg.model, cfg.lora, kind="causal", tokenizer=self.tokenizer)
        if TEACHER_BACKENDS[cfg.teacher.backend].in_process:
            spec = dataclasses.replace(
                cfg.teacher, path=self.teacher_path, finetuning="full", gradient_checkpointing=False
            )
            self.teacher = frozen(load_model(spec, None, kind="causal", tokenizer=self.tokenizer)).to(
                self.accelerator.device
            )
        elif self.teacher_server is None:
            opts = teacher_server_options(cfg)
            log = Path(cfg.output_dir) / "teacher_vllm.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            self.teacher_server, self.own_server = VLLMServer(self.teacher_path, opts, log_path=log).start(), True
        return Student(train_without_dropout(student), None)

    def linear_models(self) -> list:
        return [self.inner] + ([self.teacher] if self.teacher is not None else [])

    def frozen_copies(self) -> list[torch.nn.Module]:
        """The in-process teacher (under ZeRO-3 it loads partitioned, as the student does)."""
        return [self.teacher] if self.teacher is not None else []

    def on_policy(self, step: int) -> bool:
        """Whether step `step` (0-based) samples the student: one draw of its own generator seeded by
        train.seed and the step, the same on every rank and on a resumed run."""
        lmbda = self.cfg.distill.lmbda
        if lmbda >= 1.0 or lmbda <= 0.0:
            return lmbda >= 1.0
        draw = torch.rand(1, generator=torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step))
        return bool(draw.item() < lmbda)

    def completion_batch(self) -> Rollout:
        """This rank's train.batch_size conversations of the step's global batch (batch_size x ranks,
        the next ones of data.completions' seeded shuffle per pass, dealt to ranks in order) laid out
        as a rollout: the prompt up to the first trained token, every assistant token trained."""
        acc = self.accelerator
        cur, n, size = self.completion_cursor, len(self.completions), self.cfg.train.batch_size * acc.num_processes
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.train.seed + cur["epoch"])).tolist()
        if cur["position"] + size > n:
            cur["epoch"], cur["position"] = cur["epoch"] + 1, 0
            order = torch.randperm(
                n, generator=torch.Generator().manual_seed(self.cfg.train.seed + cur["epoch"])
            ).tolist()
        mine = cur["position"] + acc.process_index * self.cfg.train.batch_size
        picked = [self.completions[i] for i in order[mine : mine + self.cfg.train.batch_size]]
        cur["position"] += size
        prompts, responses, trained = [], [], []
        for sample in picked:
            ids, labels = sample["input_ids"], sample["labels"]
            start = next(i for i, label in enumerate(labels) if label != -100)
            prompts.append(ids[:start])
            responses.append(ids[start:])
            trained.append([int(label != -100) for label in labels[start:]])
        return assemble_masked(prompts, responses, trained, [True] * len(picked), self.tokenizer.pad_token_id)

    def token_losses(
        self, rollout: Rollout, rows: slice, grad: bool = True, sampled_at: Optional[float] = None
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """([n] each trained token's loss, [n] its reverse KL to the teacher, no grad, and with
        `sampled_at` [n] the student's log-prob of each token at that sampling temperature, no grad;
        else None) of `rows`. A served teacher's KL is over its top-k support plus the tail bucket
        (all it reports)."""
        cfg, device, d = self.cfg, self.accelerator.device, self.cfg.distill
        ids, attn = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
        mask = rollout.response_mask[rows].to(device).bool()
        inputs = {
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": position_ids_from_mask(attn),
            "logits_to_keep": ids.shape[1] - rollout.prompt_width + 1,
            "use_cache": False,
        }
        tokens = ids[:, rollout.prompt_width :][mask]
        with self.accelerator.autocast():
            if self.teacher is None:
                teacher = dl.Teacher(None, None, cfg.teacher.top_k, self.served_scores(rollout, rows))
                whole = teacher
            else:
                with torch.no_grad():
                    t_head = head_split(self.teacher)
                    t_rows = (
                        hidden_forward(self.teacher, t_head, **inputs)
                        if t_head is not None
                        else self.teacher(**inputs).logits
                    )
                teacher = dl.Teacher(t_rows[:, :-1][mask], t_head, cfg.teacher.top_k)
                whole = dl.Teacher(teacher.rows, t_head)
            s_head = head_split(self.inner.policy, self.accelerator)
            with torch.set_grad_enabled(grad):
                s_rows = self.model(s_head, **inputs)[:, :-1][mask]
                losses = dl.per_token_losses(
                    d.loss_type, s_rows, s_head, teacher, tokens, beta=d.beta, temperature=d.temperature
                )
            with torch.no_grad():
                kl = dl.per_token_losses(
                    "jsd",
                    s_rows.detach(),
                    s_head,
                    whole,
                    tokens,
                    beta=1.0,
                    temperature=d.temperature,
                )
                own = None
                if sampled_at is not None:
                    own = chunked_rows(
                        lambda logits, ids: dl.sampled_logp(logits, ids, sampled_at), s_rows.detach(), s_head, tokens
                    )
        return losses, kl, own

    def served_scores(self, rollout: Rollout, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The served teacher's top-k of every trained token of `rows` (row-major, as `[mask]`
        orders them): each row's tokens without padding go to the server, whose prompt log-probs
        at a token's position are the teacher's distribution for that token."""
        ids, attn = rollout.input_ids[rows].cpu(), rollout.attention_mask[rows].cpu().bool()
        mask, width = rollout.response_mask[rows].cpu().bool(), rollout.prompt_width
        sequences, places = [], []
        for r in range(ids.shape[0]):
            first = int(attn[r].nonzero()[0])  # left padding before the prompt
            sequences.append(ids[r][attn[r]].tolist())
            places.append((mask[r].nonzero().flatten() + width - first).tolist())
        scored = prompt_topk(self.teacher_server, sequences, self.cfg.teacher.top_k)
        return dl.served_topk([scored[r][p] for r in range(len(places)) for p in places[r]], self.cfg.teacher.top_k)

    def train_step(self) -> dict[str, float]:
        """A batch (the student's samples with probability lmbda, else the dataset's completions), the
        teacher's scores and one optimizer step of the distillation loss over it."""
        cfg, acc = self.cfg, self.accelerator
        started = time.perf_counter()
        on_policy = self.on_policy(self.step)
        if on_policy:
            (indices,) = self.next_sample_indices(grad_accum=1)
            rollout = self.rollout([self.train_samples[i] for i in indices])
        else:
            rollout = self.completion_batch()
        gen_time = time.perf_counter() - started
        accum = cfg.train.grad_accum
        micro = rollout.input_ids.shape[0] // accum
        tokens = rollout.response_mask.sum().double()
        if acc.num_processes > 1:
            tokens = acc.reduce(tokens.to(acc.device), reduction="sum").cpu()
        scale = accum * acc.num_processes  # the losses are shares of the step's token sum already
        sums = torch.zeros(2, dtype=torch.float64)
        engine = rollout.engine_logp if on_policy else None  # an engine that reports its log-probs (vLLM)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the student's, the engine's) per sampled token

        def micro_batch(k: int) -> torch.Tensor:
            rows = slice(k * micro, (k + 1) * micro)
            losses, kl, own = self.token_losses(
                rollout, rows, sampled_at=None if engine is None else cfg.generation.temperature
            )
            loss = dl.global_token_loss(losses, float(tokens))
            acc.backward(loss * scale)
            sums[0] += float(loss.detach())
            sums[1] += float(kl.sum())
            if own is not None:
                pairs.append((own.cpu(), engine[rows][rollout.response_mask[rows].bool()]))
            return loss

        grad_norm = self.optimizer_step(accum, micro_batch)
        if acc.num_processes > 1:
            sums = acc.reduce(sums.to(acc.device), reduction="sum").cpu()
        return self.mismatch(pairs) | {
            "train/loss": float(sums[0]),
            "train/grad_norm": grad_norm,
            "distill/kl": float(sums[1] / tokens.clamp(min=1)),
            "distill/on_policy": float(on_policy),
            "distill/gen_time": gen_time if on_policy else 0.0,
            "distill/gen_time_frac": gen_time / (time.perf_counter() - started),
            "distill/completion_length": float(tokens) / (rollout.input_ids.shape[0] * acc.num_processes),
        }

    @staticmethod
    def mismatch(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """rollout/logprob_diff_mean and _max: the engine's log-prob of each sampled token against the
        student's at the sampling temperature in the step's forward, as PPO and GRPO log them ({}:
        a step on the dataset's completions, or an engine that reports no log-probs)."""
        if not pairs:
            return {}
        own, engine = (torch.cat(side) for side in zip(*pairs))
        mean, worst = logprob_diff(own, engine, torch.ones_like(own))
        return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": worst}

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/kl: the student's per-token reverse KL to the teacher on one sampled completion per
        held-out prompt, under a forked RNG seeded the same way at every evaluation."""
        if not self.eval_samples:
            return None

        def figures(indices: list[int]) -> dict:
            _, kl, _ = self.token_losses(self.rollout([self.eval_samples[i] for i in indices]), slice(None), grad=False)
            return {"kl": kl.sum(), "tokens": kl.numel()}

        with seeded_fork(self.cfg.train.seed + 1):
            kl = ratio(self.held_out(figures), "kl", "tokens")
        return {"eval/kl": kl, "eval/loss": kl}

    def state_dict(self) -> dict:
        return {"completion_cursor": dict(self.completion_cursor)}

    def load_state_dict(self, state: dict) -> None:
        self.completion_cursor = dict(state.get("completion_cursor", self.completion_cursor))

    def training_data(self) -> tuple[str, ...]:
        """The prompts, and data.completions where the off-policy steps train on them (lmbda < 1)."""
        return super().training_data() + (("data.completions",) if self.cfg.distill.lmbda < 1.0 else ())

    def input_models(self) -> dict[str, str]:
        """The teacher: what the student learns is its distribution, so new weights at teacher.path
        change the run as a changed setting does."""
        return {"teacher.path": self.teacher_path} if self.teacher_path else {}

    def manifest_extras(self) -> dict:
        """The teacher the student learned from (the driver can tell when it changed)."""
        return {
            "teacher": {
                "path": self.teacher_path,
                "weights_hash": weights_hash(self.teacher_path),
                "loss_type": self.cfg.distill.loss_type,
                "top_k": self.cfg.teacher.top_k,
                "backend": self.cfg.teacher.backend,
            }
        }

    def release(self) -> None:
        super().release()
        self.teacher = None
        if self.own_server and self.teacher_server is not None:
            self.teacher_server.stop()
        self.teacher_server, self.own_server = None, False

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{figures['train/loss']:.4f}", "kl": f"{figures['distill/kl']:.4f}"}

    def summary(self) -> dict:
        return {
            **self.history.pick(
                loss_first="train/loss:first",
                loss_last="train/loss",
                kl_first="distill/kl:first",
                kl_last="distill/kl",
                eval_kl_first="eval/kl:first",
                eval_kl_last="eval/kl",
            ),
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(DistillStage))
