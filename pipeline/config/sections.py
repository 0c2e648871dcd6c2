"""The typed config sections every stage is built from (model, LoRA, training, checkpoints,
tracking, distribution, data) and `StageConfig`, the keys every stage has. Loading them from YAML
and the command line is pipeline/config/loading.py."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from pipeline.config.engines import ENGINES
from pipeline.config.schedule_shape import schedule_problems

DTYPES = ("auto", "fp32", "bf16", "fp16")
PRECISIONS = DTYPES + ("bf16-pure",)
FINETUNING = ("full", "lora", "qlora")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")
SCHEDULES = ("constant", "linear", "cosine", "inv_sqrt", "inv")

STAGE_REF = "stage:"
"""A model key's value (StageInfo.models) that names a chain stage's merged model, e.g.
`teacher.path: stage:ppo`; only the pipeline driver resolves it."""


class ConfigError(ValueError):
    """One or more configuration problems; ``problems`` lists every one of them."""

    def __init__(self, problems: Sequence[str], source: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


def _choice(problems: list[str], key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        problems.append(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _positive(problems: list[str], key: str, value: Optional[float], allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        problems.append(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


# --------------------------------------------------------------------------------------------
# Shared sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    path: str = "embedded"
    """Base model: a Hugging Face folder, a hub id (when reachable), or 'embedded' (the bundled
    SmolLM2-135M-Instruct). Empty means 'embedded'."""
    finetuning: str = "lora"
    """How weights are trained: 'full', 'lora', or 'qlora' (4-bit nf4 base + LoRA)."""
    dtype: str = "auto"
    """Dtype the weights are loaded in: auto|fp32|bf16|fp16. 'auto' is bf16 on a GPU that supports
    it, fp32 otherwise."""
    attn_implementation: str = "sdpa"
    """Attention kernel: sdpa (default), eager, flash_attention_2 (CUDA with flash-attn), or
    flex_attention (CUDA; packed rows get a document block mask that skips cross-document blocks)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    trust_remote_code: bool = False
    """Allow model code from the model folder to run (its config.json `auto_map`). Off unless you
    trust the folder; honoured by every load of it, the merge included. When off, a folder that
    ships custom code for a model_type transformers knows loads the stock class, with a warning."""
    allow_pickle: bool = False
    """Load pickled weights (pytorch_model.bin / .pt) when the folder has no safetensors. Unpickling
    a file can run code, so such a folder is refused unless you set this for a folder you trust;
    even then it is read with torch.load(weights_only=True), which refuses anything but tensors."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) when `path` is a hub id."""

    def problems(self, key: str = "model") -> list[str]:
        out: list[str] = []
        _choice(out, f"{key}.finetuning", self.finetuning, FINETUNING)
        _choice(out, f"{key}.dtype", self.dtype, DTYPES)
        _choice(out, f"{key}.attn_implementation", self.attn_implementation, ATTENTION)
        return out


@dataclass
class LoraConfig:
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; ['all-linear'] adapts every linear layer except the output head."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapter (the reward stage adds its 'score' head)."""
    quant_type: str = "nf4"
    """QLoRA 4-bit quantisation type: nf4 or fp4."""
    double_quant: bool = True
    """QLoRA: also quantise the quantisation constants."""

    def problems(self, key: str = "lora") -> list[str]:
        out: list[str] = []
        _positive(out, f"{key}.r", self.r)
        _positive(out, f"{key}.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            out.append(f"{key}.dropout: must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            out.append(f"{key}.target_modules: must name at least one module (or 'all-linear')")
        _choice(out, f"{key}.quant_type", self.quant_type, ("nf4", "fp4"))
        return out


@dataclass
class DivergenceConfig:
    """When a run counts as diverged: it stops with one line, keeps its last checkpoint and
    publishes nothing (no adapter, no merged/)."""

    enabled: bool = True
    """Check after every optimizer step."""
    loss_ratio: float = 2.0
    """Diverged when the mean `train/loss` of the last `window` steps exceeds this times the
    mean of the first `window` steps (a LoRA run stuck at ln(vocab) from a start near 2.5 is 4x)."""
    window: int = 10
    """Steps averaged on each side of the loss comparison (it starts once 2 x window steps ran)."""
    max_weight_abs: float = 1e4
    """Diverged when any trainable weight's magnitude exceeds this (weights of 6e10 are not a
    model any more; healthy fine-tuned weights stay far below)."""

    def problems(self, key: str = "train.divergence") -> list[str]:
        out: list[str] = []
        if self.loss_ratio <= 1:
            out.append(f"{key}.loss_ratio: must be > 1, got {self.loss_ratio!r}")
        _positive(out, f"{key}.window", self.window)
        _positive(out, f"{key}.max_weight_abs", self.max_weight_abs)
        return out


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps to run."""
    learning_rate: float = 2e-4
    """Peak learning rate."""
    batch_size: int = 4
    """Samples per device per micro-batch (PT: rows of seq_length tokens cut from its documents;
    with data.padding_mode pack a micro-batch's samples share as few rows as they fill, so packing
    removes padding, not samples per step)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. Global batch = batch_size * grad_accum * world size."""
    seq_length: int = 512
    """Maximum tokens per sample (or per packed row)."""
    seed: int = 42
    """Seed for model init, data order, dropout and sampling."""
    precision: str = "auto"
    """Autocast precision: auto|fp32|bf16|fp16|bf16-pure. 'auto' is bf16 on a GPU that supports it, fp32 on
    CPU. Under bf16/fp16 autocast the trainable weights and the optimizer's state stay fp32 (master
    weights, as DeepSpeed keeps them); 'bf16-pure' keeps them in bf16 too, half the memory, and
    small updates round away."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    lr_schedule: str = "cosine"
    """Decay shape: constant, linear, cosine, inv_sqrt or inv (Levanter's schedules)."""
    warmup: float = 0.01
    """Warmup: a fraction of a cycle (< 1) or a number of steps (>= 1)."""
    decay: Optional[float] = None
    """Decay length: fraction of a cycle or steps. None: everything after warmup decays."""
    min_lr_ratio: float = 0.1
    """The LR decays to min_lr_ratio * learning_rate at the end of each cycle."""
    rewarmup: float = 0.0
    """Re-warmup at the start of each later cycle: fraction of a cycle or steps."""
    cycles: Optional[Union[int, list[int]]] = None
    """The number of cycles (3), or the steps where cycles end as a list ([1000, 2500]; [1000]: one
    end), as in Levanter's guide."""
    cycle_length: Optional[Union[float, list[float]]] = None
    """Every cycle's length in steps, or as a fraction of the run (< 1); or a list of the cycles'
    lengths ([300]: one cycle of 300, the rest another). Not with `cycles`."""
    log_steps: int = 1
    """Log training metrics every this many steps."""
    eval_steps: int = 50
    """Evaluate on the held-out split every this many steps (0 disables)."""
    eval_batches: Optional[int] = None
    """Evaluate on at most this many batches, spread evenly over the split (None: the whole split)."""
    early_stopping_stall_num: int = 0
    """Stop after this many evaluations without a new best eval loss (0 disables; MFTCoder)."""
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    """When the run is stopped as diverged."""

    def problems(self, key: str = "train") -> list[str]:
        out: list[str] = []
        for name in ("max_steps", "batch_size", "grad_accum", "seq_length", "log_steps"):
            _positive(out, f"{key}.{name}", getattr(self, name))
        _positive(out, f"{key}.learning_rate", self.learning_rate)
        if self.seq_length == 1:
            out.append(
                f"{key}.seq_length: 1 token leaves nothing to predict (a label needs a token before it); use at least 2"
            )
        out.extend(self.divergence.problems(f"{key}.divergence"))
        _positive(out, f"{key}.eval_steps", self.eval_steps, allow_zero=True)
        _positive(out, f"{key}.early_stopping_stall_num", self.early_stopping_stall_num, allow_zero=True)
        _positive(out, f"{key}.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _choice(out, f"{key}.precision", self.precision, PRECISIONS)
        _choice(out, f"{key}.lr_schedule", self.lr_schedule, SCHEDULES)
        if not 0 <= self.min_lr_ratio <= 1:
            out.append(f"{key}.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.cycles is not None and self.cycle_length is not None:
            out.append(f"{key}: set cycles or cycle_length, not both (Levanter's rule)")
        inputs = ("max_steps", "lr_schedule", "min_lr_ratio", f"{key}: set cycles")
        if not any(p.startswith((f"{key}.{name}", name)) for p in out for name in inputs):
            out.extend(schedule_problems(self))  # built now: a schedule that cannot be is refused before any load
        return out


@dataclass
class KeepPolicy:
    every: int = 10000
    """Keep a permanent checkpoint every this many steps..."""
    until: Optional[int] = None
    """...up to this step (None: for the rest of the run)."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")


def parse_duration(text: Union[str, float, int]) -> float:
    """Seconds in a duration such as '90s', '15m', '1.5h', '2d' or a bare number of seconds.

    Raises:
        ValueError: the text is not a duration.
    """
    if isinstance(text, (int, float)):
        return float(text)
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a duration like '30s', '15m' or '1h'")
    scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2) or "s"]
    return float(match.group(1)) * scale


@dataclass
class CheckpointConfig:
    save_interval: str = "15m"
    """Temporary checkpoint every this long (e.g. '30s', '15m'); the previous temporary one is
    deleted once the new one is complete."""
    keep: list[KeepPolicy] = field(default_factory=lambda: [KeepPolicy(every=10000)])
    """Permanent step-based checkpoints: a list of {every, until} rules (Levanter's keep policy)."""
    resume: Union[bool, str] = True
    """true: resume from the newest complete checkpoint in <output_dir>/checkpoints if any;
    false: start fresh; a path: resume from that checkpoint."""
    resume_changed: bool = False
    """Resume although the config or the training data changed since the checkpoint (the
    differences are listed when refused): the new values apply from the resumed step on, and the
    manifest records them (`resume_changes`). Another stage's folder, another parent model or
    another LoRA shape is never resumed."""

    def problems(self, key: str = "checkpoint") -> list[str]:
        out: list[str] = []
        try:
            parse_duration(self.save_interval)
        except ValueError as err:
            out.append(f"{key}.save_interval: {err}")
        last_until = 0
        for i, rule in enumerate(self.keep):  # a rule applies up to its until, after the ones before it
            _positive(out, f"{key}.keep[{i}].every", rule.every)
            if rule.until is None and i < len(self.keep) - 1:
                out.append(
                    f"{key}.keep[{i}]: only the last rule may run to the end (until: null); the rules after it "
                    "would never apply (Levanter's rule)"
                )
            elif rule.until is not None and rule.until < 1:
                out.append(f"{key}.keep[{i}].until: must be a step >= 1 (or null: to the end), got {rule.until}")
            elif rule.until is not None and rule.until <= last_until:
                out.append(
                    f"{key}.keep[{i}].until: {rule.until} must be above the previous rule's "
                    f"({last_until}): rules are in order of until (Levanter's rule)"
                )
            last_until = rule.until if rule.until is not None else last_until
        return out


@dataclass
class TrackingConfig:
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where curves go: any of tensorboard (<output_dir>/runs/), wandb. Several at once is fine."""
    project: str = "relay"
    """Project name for trackers that have one (W&B)."""
    run_name: Optional[str] = None
    """Run name; default is the stage name and a timestamp."""
    entity: Optional[str] = None
    """W&B entity (team or user)."""

    def problems(self, key: str = "tracking") -> list[str]:
        import importlib.util

        out: list[str] = []
        for name in self.trackers:
            _choice(out, f"{key}.trackers", name, ("tensorboard", "wandb"))
        if "wandb" in self.trackers and importlib.util.find_spec("wandb") is None:
            out.append(f"{key}.trackers has 'wandb' but wandb is not installed: pip install wandb")
        return out


@dataclass
class DistributedConfig:
    engine: str = "ddp"
    """Data-parallel engine: ddp, deepspeed (both through accelerate; DeepSpeed ZeRO on a CUDA GPU,
    or on CPU ranks over gloo) or fsdp (torch's FSDP2, on CPU over gloo or on CUDA over nccl)."""
    deepspeed_config: Optional[str] = None
    """DeepSpeed JSON (see deepspeed_configs/); required when engine is deepspeed."""
    fsdp_sharding: str = "FULL_SHARD"
    """FSDP sharding strategy: FULL_SHARD (a block's gathered weights are freed after its forward)
    or SHARD_GRAD_OP (kept to its backward); NO_SHARD has no FSDP2 form (refused: use ddp)."""

    def problems(self, key: str = "distributed") -> list[str]:
        """The engine's name, the file its entry needs (pipeline/config/engines.py), and every
        engine's own options."""
        out: list[str] = []
        _choice(out, f"{key}.engine", self.engine, tuple(ENGINES))
        facts = ENGINES.get(self.engine)
        if facts is not None and facts.config_file is not None:
            path = getattr(self, facts.config_file)
            if not path:
                out.append(f"{key}.{facts.config_file}: required when {key}.engine is {self.engine}")
            elif not Path(path).is_file():
                out.append(f"{key}.{facts.config_file}: no such file {path!r}")
        for entry in ENGINES.values():
            out += entry.option_problems(self, key)
        return out


# --------------------------------------------------------------------------------------------
# Data sections (one per kind of data; the stage picks the one it reads)
# --------------------------------------------------------------------------------------------

DEFAULT_ROLE_MARKERS = {"system": "<s>system\n", "user": "<s>human\n", "assistant": "<s>bot\n"}


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)
    """Training data: files, folders, globs or dataset names. Each entry is a task in SFT."""
    eval: list[str] = field(default_factory=list)
    """Held-out data, same forms as `train`."""
    eval_fraction: float = 0.0
    """Carve this fraction off the training data for evaluation when `eval` is empty."""
    format: str = "auto"
    """Record format; 'auto' detects it per file."""
    on_error: str = "strict"
    """Bad records: 'strict' refuses to train and lists them; 'skip' drops exactly those and logs why."""
    max_samples: Optional[int] = None
    """Use at most this many training records, the first ones (debugging); None or -1 (MedicalGPT's
    spelling): all of them."""
    max_record_bytes: int = 8 * 1024 * 1024
    """Refuse any record (a JSONL line, a JSON array element, a .txt file, a Parquet row) longer than
    this many bytes as `FILE:LINE: record is N bytes, over the limit`, before it is parsed or
    tokenized (a JSONL line is never held whole). Default 8 MiB: hundreds of times a long training
    sample, and what a broken export (a whole corpus on one line) usually exceeds. Raise it for PT
    corpora of very large single documents."""
    weights: Optional[list[float]] = None
    """Sampling probability of each `train` entry, in their order (normalised to sum 1): every
    training sample is drawn from entry k with probability weights[k], from that entry's own
    shuffled order (LLaMA-Factory's interleave_probs, OpenRLHF's dataset_probs). E.g. a domain
    corpus and general text mixed back in: `train: [medical.jsonl, general.jsonl]`,
    `weights: [0.7, 0.3]`. Seeded by train.seed; recorded in the manifest (`data_mix`); TensorBoard
    shows data/samples/<name> and data/tokens/<name> per step (an entry's task name, its file stem; #k
    for its position when two entries share one).
    None: the entries are pooled and shuffled together."""
    mix_stop: Union[int, str] = "first_exhausted"
    """When an epoch of a weighted mix ends (data.weights): 'first_exhausted' as soon as one entry
    has given all its samples (no sample repeats within an epoch); 'all_exhausted' once every entry
    has, an entry that runs out starting over reshuffled (small entries are oversampled); or a
    number of samples per epoch, entries starting over as needed. A streamed PT corpus never ends:
    its entries start over when they run out, whatever this says."""

    @property
    def has_eval(self) -> bool:
        """Whether there is held-out data: `eval` entries, or a fraction carved off `train`."""
        return bool(self.eval) or self.eval_fraction > 0

    @property
    def record_limit(self) -> Optional[int]:
        """How many training records are used at most (`max_samples`); None: all."""
        return None if self.max_samples in (None, -1) else self.max_samples

    def problems(self, key: str = "data") -> list[str]:
        out: list[str] = []
        _choice(out, f"{key}.on_error", self.on_error, ("strict", "skip"))
        out.extend(self.mix_problems(key))
        if self.max_record_bytes < 1:
            out.append(f"{key}.max_record_bytes: must be >= 1, got {self.max_record_bytes!r}")
        if not 0 <= self.eval_fraction < 1:
            out.append(f"{key}.eval_fraction: must be in [0, 1), got {self.eval_fraction!r}")
        if self.eval and self.eval_fraction > 0:
            out.append(f"{key}: give {key}.eval or {key}.eval_fraction, not both (the fraction would carve nothing)")
        if self.max_samples is not None and self.max_samples != -1 and self.max_samples < 1:
            out.append(f"{key}.max_samples: must be >= 1, or null / -1 for every record, got {self.max_samples}")
        if not self.train:
            out.append(f"{key}.train: no training data given")
        return out

    def mix_problems(self, key: str = "data") -> list[str]:
        """Weights that do not match the entries, and stopping policies that are none."""
        out: list[str] = []
        stop = self.mix_stop
        if (
            isinstance(stop, bool)
            or (isinstance(stop, int) and stop < 1)
            or (isinstance(stop, str) and stop not in ("first_exhausted", "all_exhausted"))
        ):
            out.append(
                f"{key}.mix_stop: must be first_exhausted, all_exhausted or a number of samples >= 1, got {stop!r}"
            )
        if self.weights is None:
            return out
        if len(self.weights) != len(self.train):
            out.append(
                f"{key}.weights: {len(self.weights)} weight(s) for {len(self.train)} {key}.train entr(ies); "
                f"give one per entry, in their order"
            )
        bad = [w for w in self.weights if not w > 0]
        if bad:
            out.append(f"{key}.weights: every weight must be > 0 (leave an entry out instead), got {bad}")
        return out


@dataclass
class TextDataConfig(DataConfig):
    """Raw text for continued pretraining."""

    text_field: str = "text"
    """Field holding the document in JSON/JSONL/Parquet records."""
    streaming: bool = False
    """Read the training corpus lazily, in file order, instead of tokenizing it into memory and
    shuffling it (for corpora that do not fit in memory); resume restores the stream position.
    Eval data is still loaded into memory."""


@dataclass
class ChatDataConfig(DataConfig):
    """Conversations rendered with a chat template (SFT, and the base for RM and PPO data)."""

    template: str = "chat_template"
    """'chat_template' (the tokenizer's Jinja template) or 'role_markers' (MFTCoder's format)."""
    role_markers: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_MARKERS))
    """Markers that open each role's turn in role_markers mode (MFTCoder's default)."""
    role_layout: str = "readme"
    """role_markers mode: 'readme' (MFTCoder's README string, `<s>human\\n{u}<s>bot\\n{a}{EOS}\\n`; the
    seed's format, so the default) or 'code' (what MFTCoder's code writes: every content followed by
    "\\n", `<s>human\\n{u}\\n<s>bot\\n{a}\\n{EOS}\\n`, for continuing a CodeFuse model byte for byte)."""
    system_prompt: Optional[str] = None
    """System turn added to conversations that have none (None: add nothing)."""
    padding_mode: str = "padding"
    """'padding' (pad to the longest sample in the batch) or 'pack' (several samples per row)."""
    truncation: str = "drop"
    """Overlong samples: 'drop' them, or 'truncate' keeping whole early turns."""

    def problems(self, key: str = "data") -> list[str]:
        out = super().problems(key)
        _choice(out, f"{key}.template", self.template, ("chat_template", "role_markers"))
        _choice(out, f"{key}.role_layout", self.role_layout, ("readme", "code"))
        _choice(out, f"{key}.padding_mode", self.padding_mode, ("padding", "pack"))
        _choice(out, f"{key}.truncation", self.truncation, ("drop", "truncate"))
        missing = {"system", "user", "assistant"} - set(self.role_markers)
        if self.template == "role_markers" and missing:
            out.append(f"{key}.role_markers: missing marker(s) for {', '.join(sorted(missing))}")
        unknown = set(self.role_markers) - {"system", "user", "assistant"}
        if unknown:
            out.append(
                f"{key}.role_markers: no role {', '.join(map(repr, sorted(unknown)))}; "
                "markers are for system, user and assistant"
            )
        if self.template != "role_markers":
            for name, default in (("role_markers", DEFAULT_ROLE_MARKERS), ("role_layout", "readme")):
                if getattr(self, name) != default:
                    out.append(
                        f"{key}.{name}: read only with {key}.template: role_markers (the chat template writes "
                        f"its own turn markers); set the template, or leave {name} out"
                    )
        return out


@dataclass
class PreferenceDataConfig(ChatDataConfig):
    """Preference pairs for the reward model."""

    margin_field: Optional[str] = None
    """Optional per-pair margin column used in -logsigmoid(r_c - r_r - margin)."""


@dataclass
class PromptDataConfig(ChatDataConfig):
    """Prompts for PPO rollouts."""

    max_prompt_length: int = 256
    """Prompts longer than this many tokens (or than train.seq_length - generation.max_new_tokens) are handled by
    `truncation`."""

    def problems(self, key: str = "data") -> list[str]:
        out = super().problems(key)
        if self.padding_mode == "pack":
            out.append(
                f"{key}.padding_mode: the stages that sample from prompts pad each prompt to its own row "
                "('padding'); packing is not supported"
            )
        return out


# --------------------------------------------------------------------------------------------
# The common stage config
# --------------------------------------------------------------------------------------------


@dataclass
class StageConfig:
    """Keys every stage has. A stage subclasses this and adds its `data` section and its own."""

    output_dir: str = "outputs/run"
    """Everything goes here: checkpoints/, runs/ (TensorBoard), merged/ (with manifest.json)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def problems(self) -> list[str]:
        """Every problem in every section (sections with a `problems` method)."""
        out: list[str] = []
        if not self.output_dir:
            out.append("output_dir: must not be empty")
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "problems"):
                out.extend(section.problems(f.name))
        return out
