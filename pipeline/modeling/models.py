"""The one model loader every stage uses: causal LMs and reward/value models, full, LoRA or QLoRA.

    from pipeline.modeling.models import load_model, load_tokenizer
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
    model = load_model(cfg.model, cfg.lora, kind="causal", tokenizer=tokenizer)

Everything goes through transformers' ``from_pretrained`` and peft's ``get_peft_model``; this module
only decides their arguments (dtype, attention kernel, quantisation, LoRA targets) and refuses the
combinations that would otherwise degrade silently (flash-attention without CUDA, QLoRA without a
LoRA config, a pad token equal to the trained end-of-turn token).

Untrusted folders: weights load from safetensors only (transformers never unpickles then), unless
`model.allow_pickle` is set, and then through torch.load(weights_only=True); a pickle-only folder
without it is refused before anything loads by pipeline.modeling.preflight. Code in a folder
(config.json `auto_map`) runs only with `model.trust_remote_code`; without it a folder whose
model_type transformers knows loads the stock class, with one warning that its custom code is
ignored, and one whose model_type it does not know is refused (`remote_code_problems`), as is one
whose weights the stock class would not hold as they are (`stock_fit_problem`: tensors it has no
place for, or tensors it would start from random).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedTokenizerBase,
)

from pipeline.config import LoraConfig, ModelConfig
from pipeline.modeling.embedded import is_embedded, resolve_model_path

log = logging.getLogger(__name__)

KINDS = ("causal", "reward")
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_LINEAR = "all-linear"
# The reward / value head of AutoModelForSequenceClassification for Llama-like models.
SCORE_HEAD = "score"
# Tried in order when a tokenizer has no usable pad token: special tokens that a chat template
# never emits, so using one as padding does not collide with a trained token.
PAD_CANDIDATES = ("<|endoftext|>", "<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
ADDED_PAD_TOKEN = "<|relay_pad|>"
_warned_custom_code: set[str] = set()


def custom_code(folder: str | Path) -> Optional[dict[str, Any]]:
    """What a local folder's config.json asks to run: {'model_type', 'auto_map' (class names),
    'known' (transformers has its own class for the model_type)}, or None when there is no
    `auto_map` (or no readable config.json)."""
    config = Path(folder) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("auto_map"):
        return None
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    return {"model_type": model_type, "auto_map": sorted(data["auto_map"]), "known": model_type in CONFIG_MAPPING}


def remote_code_problems(model_cfg: ModelConfig, key: str = "model", opt_in: Optional[str] = None) -> list[str]:
    """A folder that cannot load without running its own code (auto_map for a model_type
    transformers does not know) while `{key}.trust_remote_code` is off: one line, else []. `opt_in`
    is the line's advice: how the caller's user runs that code (by default a config's
    `{key}.trust_remote_code: true`)."""
    if is_embedded(model_cfg.path) or model_cfg.trust_remote_code:
        return []
    opt_in = opt_in or f"set {key}.trust_remote_code: true if you trust the folder"
    folder = Path(str(model_cfg.path))
    code = custom_code(folder)
    if not code:
        return []
    if code["known"]:
        fit = stock_fit_problem(folder, code["model_type"])
        return [f"{key}.path: {folder} ships its own code (auto_map) and {fit}; {opt_in}"] if fit else []
    return [
        f"{key}.path: {folder} needs its own code: model_type {code['model_type']!r} is not a transformers model "
        f"and config.json maps {', '.join(code['auto_map'])} to code in the folder (auto_map); {opt_in}"
    ]


def checkpoint_tensor_names(folder: Path) -> Optional[set[str]]:
    """The tensor names of a folder's safetensors weights, read from their headers (nothing
    loads), or None when it has none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    if not (folder / "model.safetensors").is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        return set(weights.keys())


def stock_fit_problem(folder: Path, model_type: str) -> Optional[str]:
    """Why transformers' own causal-LM class for `model_type` cannot be the folder's model (its
    weights hold tensors the class has no place for, or lack some it needs: they would be dropped
    or start from random), or None. The class is built on the meta device: nothing is allocated.
    Output heads (lm_head, score) are left out: a reward stage replaces them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = checkpoint_tensor_names(folder)
    if names is None or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    with init_empty_weights():
        stock = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=False))
    heads = ("lm_head.", "score.")
    expected = {n for n in stock.state_dict() if not n.startswith(heads)}
    found = {n for n in names if not n.startswith(heads)}
    unknown, missing = sorted(found - expected), sorted(expected - found)
    if not unknown and not missing:
        return None
    parts = [f"{len(unknown)} tensor(s) it has no place for (first: {unknown[0]})"] if unknown else []
    parts += [f"{len(missing)} tensor(s) it would start from random (first: {missing[0]})"] if missing else []
    return (
        f"its weights do not fit transformers' {type(stock).__name__} for model_type {model_type!r}: {', '.join(parts)}"
    )


def warn_ignored_code(path: str | Path, trust_remote_code: bool) -> Optional[str]:
    """Log (once per folder) that a folder's custom code is ignored, when it ships some (auto_map)
    for a model_type transformers knows and trust_remote_code is off; return the message."""
    code = custom_code(path)
    if trust_remote_code or not code or not code["known"]:
        return None
    message = (
        f"{path}: config.json maps {', '.join(code['auto_map'])} to custom code in the folder (auto_map); "
        f"trust_remote_code is false, so that code is ignored and the stock transformers class for model_type "
        f"{code['model_type']!r} is used (set model.trust_remote_code: true if you trust the folder and need its code)"
    )
    if str(path) not in _warned_custom_code:
        _warned_custom_code.add(str(path))
        log.warning("%s", message)
    return message


def resolve_dtype(name: str) -> torch.dtype:
    """torch dtype for 'fp32' | 'bf16' | 'fp16' | 'auto' ('auto': bf16 on a CUDA GPU that has it,
    else fp32, because bf16 matmuls on CPU are slow and fp16 training needs loss scaling).

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not one of 'auto', {', '.join(map(repr, DTYPE_NAMES))}")
    return DTYPE_NAMES[name]


def check_attn_implementation(name: str) -> str:
    """Return `name` when it can run here.

    Raises:
        ValueError: an unknown name, flex_attention without CUDA, or flash_attention_2 without CUDA
            or without the flash-attn package (transformers would otherwise fail late or the user
            would believe they run flash-attention when they do not).
    """
    if name in ("sdpa", "eager"):
        return name
    if name == "flex_attention":
        # PyTorch's flex attention has no backward on a CPU, so it could not train there.
        if not torch.cuda.is_available():
            raise ValueError(
                "attn_implementation 'flex_attention' trains "
                "on a CUDA GPU only (PyTorch has no CPU backward for it). Use 'sdpa'."
            )
        return name
    if name != "flash_attention_2":
        raise ValueError(
            f"attn_implementation {name!r} is not one of 'sdpa', 'eager', 'flash_attention_2', 'flex_attention'"
        )
    if not torch.cuda.is_available():
        raise ValueError("attn_implementation 'flash_attention_2' needs a CUDA GPU; none is visible. Use 'sdpa'.")
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attn_implementation 'flash_attention_2' needs the flash-attn package: pip install flash-attn")
    return name


def _pick_pad_token(tokenizer: PreTrainedTokenizerBase) -> Optional[str]:
    """An existing special token that is safe to pad with (not EOS, not BOS), or None."""
    vocab = tokenizer.get_vocab()
    trained = {tokenizer.eos_token, tokenizer.bos_token}
    candidates = [tokenizer.unk_token, *PAD_CANDIDATES]
    for token in candidates:
        if token and token in vocab and token not in trained:
            return token
    return None


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Give `tokenizer` a pad token distinct from EOS/BOS; return True when a token was *added*
    (the model's embeddings must then be resized, which load_model does).

    A pad equal to EOS is replaced too: SFT trains on EOS, and the reward model locates the last
    real token by the first pad, so padding with EOS would mis-read rewards. Every change is
    logged; nothing happens when the pad token is already distinct.
    """
    pad = tokenizer.pad_token
    if pad is not None and pad not in (tokenizer.eos_token, tokenizer.bos_token):
        return False
    reason = "has no pad token" if pad is None else f"pads with {pad!r}, a token it trains on"
    choice = _pick_pad_token(tokenizer)
    if choice is not None:
        tokenizer.pad_token = choice
        log.warning(
            "tokenizer %s; padding with the existing unused token %r (id %d)", reason, choice, tokenizer.pad_token_id
        )
        return False
    tokenizer.add_special_tokens({"pad_token": ADDED_PAD_TOKEN})
    log.warning(
        "tokenizer %s and no unused special token exists; added %r (id %d): the model's embeddings are resized",
        reason,
        ADDED_PAD_TOKEN,
        tokenizer.pad_token_id,
    )
    return True


def load_tokenizer(
    path: str, trust_remote_code: bool = False, revision: Optional[str] = None
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a folder / hub id / 'embedded', with a safe pad token (ensure_pad_token).

    Raises:
        OSError: the folder has no tokenizer (transformers' error, naming the path).
    """
    path = resolve_model_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    ensure_pad_token(tokenizer)
    return tokenizer


def _quantization_config(lora_cfg: LoraConfig, compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """bitsandbytes 4-bit config for QLoRA (nf4 + double quant by default; runs on CPU too)."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=lora_cfg.quant_type,
        bnb_4bit_use_double_quant=lora_cfg.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def from_pretrained_kwargs(model_cfg: ModelConfig, lora_cfg: Optional[LoraConfig] = None) -> dict[str, Any]:
    """The keyword arguments load_model passes to ``from_pretrained`` (pure apart from device checks).

    Raises:
        ValueError: bad dtype / attention name (see resolve_dtype, check_attn_implementation),
            flash_attention_2 in fp32, or finetuning 'qlora' without a LoRA config or under ZeRO-3.
    """
    dtype = resolve_dtype(model_cfg.dtype)
    attn = check_attn_implementation(model_cfg.attn_implementation)
    if attn == "flash_attention_2" and dtype == torch.float32:
        raise ValueError(
            "attn_implementation 'flash_attention_2' runs in bf16/fp16 only; set model.dtype to bf16, fp16 or auto"
        )
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": attn,
        "trust_remote_code": bool(model_cfg.trust_remote_code),
        # None: safetensors when the folder has them, else (allow_pickle) its pickled weights.
        "use_safetensors": None if model_cfg.allow_pickle else True,
        "weights_only": True,
        "revision": model_cfg.revision,
    }
    if model_cfg.finetuning == "qlora":
        if lora_cfg is None:
            raise ValueError("model.finetuning is 'qlora' but no LoRA config was given: QLoRA trains LoRA adapters")
        if zero3_init_active():  # found with the config problems first (accelerator.combination_problems)
            raise ValueError(
                "model.finetuning: qlora cannot load under DeepSpeed ZeRO-3 (transformers refuses the device_map "
                "that places its 4-bit weights); use ZeRO-2, ddp, or model.finetuning lora"
            )
        kwargs["quantization_config"] = _quantization_config(lora_cfg, dtype)
        # bitsandbytes quantises while placing weights; without a device map nothing is placed.
        kwargs["device_map"] = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
    return kwargs


def zero3_init_active() -> bool:
    """Whether `from_pretrained` builds models inside `deepspeed.zero.Init` here (accelerate's
    DeepSpeed plugin for a ZeRO-3 config is alive): each weight is partitioned over the ranks as
    it is created, so a parameter's own tensor is empty and `ds_shape` is its size."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def _from_pretrained(path: str, kind: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Instantiate the right Auto class; log a newly initialised reward head."""
    if kind == "causal":
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, output_loading_info=True, **kwargs
    )
    fresh = [k for k in info.get("missing_keys", []) if k.split(".")[0] == SCORE_HEAD]
    others = [k for k in info.get("missing_keys", []) if k not in fresh]
    if fresh:
        log.info(
            "%s has no reward head: the '%s' head is newly "
            "initialised (expected when loading a causal LM as a reward model)",
            path,
            SCORE_HEAD,
        )
    if others:
        raise ValueError(f"{path}: weights missing when loading as a reward model: {others[:8]}")
    return model


def _keep_the_trainable_4bit_layout(model: torch.nn.Module) -> None:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights in every layer of `model`.

    On a CPU with AVX512-BF16 (bitsandbytes 0.49 and later) a 4-bit linear repacks its weight in place
    the first time it runs in eval mode on an input without grad (a sampled rollout, a held-out
    evaluation, a reference forward); from then on every forward of that layer, training ones
    included, runs a bf16 kernel that has no backward: the gradient stops there (the adapters
    below it get none, silently) and the loss is computed in bf16; a checkpoint saved after it
    quantizes the scales again. Relay trains after such forwards, so every layer keeps the
    layout that dequantizes and has a backward, as on every other CPU and on a GPU."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def _set_pad(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """Resize embeddings for added tokens and write the pad id into the model's configs."""
    weight = model.get_input_embeddings().weight
    # Under zero.Init the weight is this rank's partition (empty); ds_shape is its whole size.
    rows = weight.ds_shape[0] if hasattr(weight, "ds_shape") else weight.shape[0]
    if len(tokenizer) > rows:
        log.warning("resizing embeddings from %d to %d rows for tokens added to the tokenizer", rows, len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))
    # HF sequence classifiers find each row's last real token through config.pad_token_id.
    model.config.pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward, non-reentrant (works with frozen inputs and DDP)."""
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the method; the old name still works but warns.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_model(
    model_cfg: ModelConfig,
    lora_cfg: Optional[LoraConfig] = None,
    *,
    kind: str = "causal",
    tokenizer: Optional[PreTrainedTokenizerBase] = None,
) -> torch.nn.Module:
    """Load a causal LM (kind='causal') or a one-output sequence classifier (kind='reward').

    `model_cfg.finetuning`: 'full' returns the plain model with every parameter trainable; 'lora'
    wraps it in a PeftModel (apply_lora); 'qlora' loads the base in 4-bit through bitsandbytes,
    prepares it for k-bit training and adds LoRA. `lora_cfg` None with 'lora' also returns the
    plain model (for inference: reference / reward models). `tokenizer` (default: the folder's,
    via load_tokenizer) sets the pad id and, if tokens were added, the embedding size.

    Raises:
        ValueError: unknown kind, bad dtype/attention (flash-attention where it cannot run),
            'qlora' without lora_cfg, weights missing for a reward model, custom code that is
            needed but not trusted (`remote_code_problems`).
        OSError: transformers could not find the model or its safetensors weights (a pickle-only
            folder without model.allow_pickle).
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    refused = remote_code_problems(model_cfg)
    if refused:
        raise ValueError("; ".join(refused))
    path = resolve_model_path(model_cfg.path)
    warn_ignored_code(path, model_cfg.trust_remote_code)
    kwargs = from_pretrained_kwargs(model_cfg, lora_cfg)
    if tokenizer is None:
        tokenizer = load_tokenizer(path, model_cfg.trust_remote_code, model_cfg.revision)
    model = _from_pretrained(path, kind, kwargs)
    _set_pad(model, tokenizer)
    quantized = model_cfg.finetuning == "qlora"
    if quantized:
        from peft import prepare_model_for_kbit_training

        _keep_the_trainable_4bit_layout(model)

        # Casts norms/head to fp32 and freezes the 4-bit base; checkpointing is enabled below.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if model_cfg.gradient_checkpointing:
        model.config.use_cache = False
        enable_checkpointing(model)
    use_lora = lora_cfg is not None and model_cfg.finetuning in ("lora", "qlora")
    if not use_lora:
        for param in model.parameters():
            param.requires_grad_(True)
        return model
    if model_cfg.gradient_checkpointing:
        # With a frozen base the embeddings' outputs need no grad, and checkpointed blocks would
        # then get inputs without grad and the LoRA weights inside them none at all.
        model.enable_input_require_grads()
    return apply_lora(model, lora_cfg, kind=kind)


def peft_lora_config(lora_cfg: LoraConfig, kind: str = "causal"):
    """peft.LoraConfig from ours: 'all-linear' shorthand, and the reward head in modules_to_save.

    Raises:
        ValueError: unknown kind.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    targets: Any = list(lora_cfg.target_modules)
    if ALL_LINEAR in targets:
        # peft accepts the shorthand only as a plain string; it then skips the output head.
        if len(targets) > 1:
            raise ValueError(f"lora.target_modules: {ALL_LINEAR!r} cannot be combined with other names: {targets}")
        targets = ALL_LINEAR
    to_save = list(lora_cfg.modules_to_save)
    if kind == "reward" and SCORE_HEAD not in to_save:
        to_save.append(SCORE_HEAD)
    return PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets,
        modules_to_save=to_save or None,
        task_type=TaskType.CAUSAL_LM if kind == "causal" else TaskType.SEQ_CLS,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, lora_cfg: LoraConfig, *, kind: str = "causal", adapter_name: str = "default"):
    """Add a LoRA adapter named `adapter_name` (a PeftModel gets one more adapter, made active).

    For kind='reward' the `score` head is in modules_to_save, so it is trained and saved with the
    adapter, while ``with model.disable_adapter():`` runs the untouched base and its original head
    (PPO uses this for the reference policy and the frozen reward model).

    Raises:
        ValueError: unknown kind, a bad target list, or an adapter name already in use.
    """
    from peft import PeftModel, get_peft_model

    config = peft_lora_config(lora_cfg, kind)
    if isinstance(model, PeftModel):
        if adapter_name in model.peft_config:
            raise ValueError(f"the model already has an adapter named {adapter_name!r}")
        model.add_adapter(adapter_name, config)
        model.set_adapter(adapter_name)
        return model
    return get_peft_model(model, config, adapter_name=adapter_name)


def trainable_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of parameters with requires_grad (what the optimizer will update)."""
    return [name for name, param in model.named_parameters() if param.requires_grad]


def adapter_disabled(model: torch.nn.Module):
    """`model.disable_adapter()` for a PeftModel (its base model: the reference of a LoRA
    policy, the reward model under a LoRA critic), a no-op context otherwise."""
    from peft import PeftModel

    return model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext()


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Run the body with every module in eval mode, then give each module back its own mode.

    `model.train(was_training)` would not do: it sets one flag on every submodule, so a model
    whose parts were in different modes (a PPO policy with dropout modules switched off) would
    come back changed.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def train_without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Train mode (so gradient checkpointing recomputes layers) with every dropout off: each
    `nn.Dropout` (LoRA's included) in eval mode and every functional attention-dropout rate 0.

    RL needs the update's forward to reproduce the rollout's log-probs exactly (the first PPO
    ratio is 1), as OpenRLHF and TRL do by disabling dropout. Eval mode would do that too, but
    transformers only checkpoints a layer whose `training` flag is set.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model
