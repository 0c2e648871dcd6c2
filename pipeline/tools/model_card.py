"""The model card: README.md of an exported model folder (`relay export`, pipeline.tools.release).

The card is built from the manifest chain (each merged folder's manifest names its parent): the
base model (its Hub id and licence where known), every stage with its hyper-parameters, data
files' sha256 (read as the stage read them, `stage_data`) and headline figures, the prompt format,
how to load it (by the model's kind), and the shipped files that SHA256SUMS lists. Everything here
reads records and writes text; copying the model, the GGUF and the checksums are release.py's.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from data_formats.sources import expand_entry
from pipeline.engine.identity import TRAINING_DATA, data_digest, training_entries
from pipeline.modeling.embedded import gguf_path
from pipeline.modeling.manifest import file_sha256, read_manifest
from pipeline.tools.gguf_check import gguf_string

GGUF_NAME = "model.gguf"
CHECKSUMS = "SHA256SUMS"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model the embedded GGUF (pipeline.modeling.embedded) was converted from."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NOT_HYPER = (  # config sections that are places and switches, not hyper-parameters
    "output_dir",
    "model",
    "data",
    "checkpoint",
    "tracking",
    "distributed",
    "train",
    "lora",
)
FINETUNING_READS: dict[str, dict[str, tuple[str, ...]]] = {
    "full": {},
    "lora": {"lora": ("quant_type", "double_quant")},
    "qlora": {"lora": ()},
}
"""model.finetuning -> {the config section it reads besides train: that section's keys it does not
read} (plain LoRA quantises nothing: the 4-bit settings are QLoRA's)."""


def manifest_chain(folder: Path, limit: int = 16) -> list[dict]:
    """The manifests from `folder` back to the base model, newest first (stops where a parent has
    no manifest or no longer exists)."""
    chain = []
    current: Optional[Path] = folder
    while current is not None and len(chain) < limit:
        manifest = read_manifest(current)
        if manifest is None:
            break
        chain.append({**manifest, "_folder": str(current)})
        parent = manifest.get("parent_path")
        current = Path(parent) if parent and Path(parent).is_dir() else None
    return chain


def trained(manifest: dict) -> bool:
    """A stage's manifest (it trained the folder), not a base model's own."""
    return bool(manifest.get("adapter_path") or manifest.get("summary"))


def run_root(manifest: dict) -> Optional[Path]:
    """The folder the stage ran in, which its relative data paths are read from: its configured
    `output_dir`, when relative, taken off the end of the run folder that holds the manifest's
    merged/ (both were read from the same working folder). None when `output_dir` is absolute or
    the run folder no longer ends with it (it was moved)."""
    output_dir = (manifest.get("config") or {}).get("output_dir")
    folder = manifest.get("_folder")
    if not output_dir or not folder or Path(output_dir).is_absolute():
        return None
    run = Path(folder).resolve().parent
    depth = len(Path(output_dir).parts)
    if not 0 < depth <= len(run.parents):
        return None
    root = run.parents[depth - 1]
    return root if (root / output_dir).resolve() == run else None


@dataclass
class StageData:
    """A stage's data as the card shows it (`stage_data`)."""

    files: list[tuple[str, str]] = field(default_factory=list)
    """(`key: path` as read from `where`, sha256 or what it is; "" when not `placed`)."""
    where: str = ""
    """How the paths are read, for the card."""
    datasets: list[str] = field(default_factory=list)
    """Hub datasets it trained on (the card's `datasets:`): only where the paths were read as the run read them."""
    stale: bool = False
    """The train files found no longer match the manifest's `data_digest` (what it trained on)."""
    placed: bool = False
    """The paths were read from a folder: the one the run ran in, or one where they match what it trained on."""


def data_keys(manifest: dict) -> list[str]:
    """The `data` keys a stage's card lists: those it trained on (the manifest's `data_digest_keys`:
    data.train, distill's data.completions), then its held-out data."""
    trained = [k.split(".", 1)[1] for k in manifest.get("data_digest_keys") or TRAINING_DATA if k.startswith("data.")]
    return list(dict.fromkeys([*trained, "eval"]))


def trained_digest(manifest: dict) -> str:
    """The digest (pipeline.engine.identity.data_digest) of the files the stage's training data keys
    name now, read from the working folder: the manifest's `data_digest` when they are unchanged."""
    keys = manifest.get("data_digest_keys") or TRAINING_DATA
    return data_digest(training_entries(manifest.get("config") or {}, keys))


def _fingerprints(data: dict, keys: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """((`key: file`, sha256 or what it is), hub dataset names) of data entries, read from the working folder."""
    out, datasets = [], []
    for key in keys:
        for entry in data.get(key) or []:
            try:
                files, dataset = expand_entry(entry)
            except (OSError, ValueError):
                files, dataset = [], None
            if dataset is not None:
                out.append((f"{key}: {entry}", "hub dataset"))
                datasets += [dataset] if HUB_ID.match(dataset) else []
            elif not files:
                out.append((f"{key}: {entry}", "not found"))
            for f in files:
                out.append((f"{key}: {f}", file_sha256(f) if f.is_file() else "not found"))
    return out, datasets


def stage_data(manifest: dict) -> StageData:
    """A stage's train/eval data entries with each file's sha256, read as the run read them: from
    its `run_root` (any folder when every entry is an absolute path), else from here when the
    train files found from here reproduce the manifest's `data_digest` (pipeline.engine.identity:
    names and bytes of the train files). Read as the run read them but not matching that digest,
    the files changed after training (`stale`). Otherwise the entries are shown as the config wrote
    them, with no hashes and no Hub datasets."""
    data = (manifest.get("config") or {}).get("data") or {}
    keys = data_keys(manifest)
    entries = [(key, entry) for key in keys for entry in data.get(key) or []]
    recorded, root = manifest.get("data_digest"), run_root(manifest)
    absolute = all(Path(entry).is_absolute() for _, entry in entries)
    if absolute:
        base, where = Path.cwd(), "absolute paths"
    elif root is not None and root.is_dir():
        base, where = root, "paths relative to the folder the stage ran in"
    elif recorded and trained_digest(manifest) == recorded:
        base = Path.cwd()
        where = (
            "paths as written in the stage's config; the train files they name from where the export ran are the "
            "ones it trained on (they reproduce its manifest's `data_digest`)"
        )
    else:
        where = (
            "paths as written in the stage's config, relative to the folder it ran in, which its manifest does "
            "not record" + ("; the files found from here are not what it trained on" if recorded else "")
        )
        return StageData([(f"{key}: {entry}", "") for key, entry in entries], where)
    with contextlib.chdir(base):
        files, datasets = _fingerprints(data, keys)
        stale = bool(recorded) and trained_digest(manifest) != recorded
    if stale:
        where += (
            "; **the train files changed since the stage trained on them** (their digest is not its "
            "manifest's `data_digest`): the sha256 below are of the files as they are now"
        )
    return StageData(files, where, [] if stale else datasets, stale, placed=True)


def hub_datasets(data: Sequence[StageData]) -> list[str]:
    """Hub dataset ids the stages trained on (the card's `datasets:`), in stage order."""
    found: list[str] = []
    for d in data:
        found += [name for name in d.datasets if name not in found]
    return found


def base_record(chain: list[dict]) -> dict:
    """The base model as the chain records it: {path, stage, weights_hash, own}. The oldest
    manifest's own folder when it is a base model's manifest (`own`), else what the oldest stage's
    manifest recorded of its parent (its folder is gone or has no manifest of its own)."""
    oldest = chain[-1] if chain else {}
    if not trained(oldest):
        return {"path": oldest.get("_folder"), "stage": oldest.get("stage"), "weights_hash": None, "own": True}
    return {
        "path": oldest.get("parent_path"),
        "stage": oldest.get("parent_stage"),
        "weights_hash": oldest.get("parent_hash"),
        "own": False,
    }


def base_model(chain: list[dict]) -> tuple[Optional[str], str]:
    """(Hub id of the base model when known, licence) from the oldest manifest of the chain: the
    embedded model's id and its GGUF's general.license, or a parent named by a Hub id."""
    base, record = chain[-1] if chain else {}, base_record(chain)
    if record["stage"] == "embedded":
        own_gguf = base.get("parent_path") if record["own"] else None
        return EMBEDDED_HUB_ID, gguf_license(own_gguf) or "unknown"
    parent = str(base.get("parent_path") or "")
    return (parent, "unknown") if HUB_ID.match(parent) and not Path(parent).exists() else (None, "unknown")


def gguf_license(path: Optional[str]) -> Optional[str]:
    """general.license of a GGUF file (the embedded model's own records), or None."""
    try:
        return gguf_string(Path(path) if path and Path(path).is_file() else gguf_path(), "general.license")
    except (OSError, ValueError):
        return None


def default_name(chain: list[dict], repo_id: Optional[str]) -> str:
    """The exported model's name: the Hub repo when uploading, else base model + last stage."""
    if repo_id:
        return repo_id
    hub_id, _ = base_model(chain)
    base = hub_id.split("/")[-1] if hub_id else Path(str(base_record(chain)["path"] or "model")).name
    stage = chain[0].get("stage") if chain else None
    return f"{base}-{stage}" if stage and stage not in ("embedded", "tiny-random") else base


def hyper_parameters(config: dict) -> list[str]:
    """One line per config section of a stage's hyper-parameters (pure)."""
    finetuning = (config.get("model") or {}).get("finetuning", "?")
    unread = FINETUNING_READS.get(finetuning, {})
    sections = ["train", *unread]
    sections += [k for k, v in config.items() if isinstance(v, dict) and k not in NOT_HYPER]
    lines = [f"finetuning: {finetuning}"]
    for key in sections:
        values = {
            k: v
            for k, v in (config.get(key) or {}).items()
            if (isinstance(v, (int, float, str, bool)) or v is None) and k not in unread.get(key, ())
        }
        if values:
            lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return lines


def _figures(summary: dict) -> str:
    parts = [
        f"{k} {v:.4f}" for k, v in summary.items() if isinstance(v, float) and k not in ("wall_seconds", "tokens_per_s")
    ]
    return ", ".join(parts) or "none recorded"


def front_matter(chain: list[dict], gguf_type: Optional[str], data: Sequence[StageData] = ()) -> list[str]:
    """The card's YAML front matter lines (the Hub reads them; pure but for the licence lookup):
    `data` is each stage's `stage_data`, whose confirmed Hub datasets are its `datasets:`."""
    import yaml

    head = chain[0] if chain else {}
    hub_id, license_id = base_model(chain)
    reward = head.get("model_kind") == "reward"
    stages = [str(m.get("stage")) for m in reversed(chain) if trained(m)]
    meta = {
        "library_name": "transformers",
        "license": license_id,
        "pipeline_tag": "text-classification" if reward else "text-generation",
        "tags": ["relay", *stages, *(["gguf"] if gguf_type else [])],
    }
    if hub_id:
        meta["base_model"] = hub_id
    datasets = hub_datasets(data)
    if datasets:
        meta["datasets"] = datasets
    return ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---"]


def base_line(chain: list[dict]) -> str:
    """The card's one line on the base model (`base_record`)."""
    hub_id, license_id = base_model(chain)
    record = base_record(chain)
    path = str(record["path"] or "?")
    if hub_id:
        named = f"[{hub_id}](https://huggingface.co/{hub_id})"
    elif record["own"]:
        named = f"`{Path(path).name}` (a local folder)"
    elif Path(path).is_dir():
        named = f"`{Path(path).name}` (a local folder with no manifest: {path})"
    else:
        named = f"`{Path(path).name}` (a local folder, no longer at {path}: as the first stage's manifest records it)"
    weights = f", weights sha256 `{record['weights_hash']}`" if record["weights_hash"] else ""
    return f"- {named} (stage `{record['stage']}`{weights}), licence: {license_id}"


def model_card(
    chain: list[dict],
    name: str,
    files: Sequence[str] = (),
    gguf_type: Optional[str] = None,
    prompt_example: Optional[str] = None,
    data: Optional[Sequence[StageData]] = None,
    own_code: bool = False,
) -> str:
    """README.md of the exported model from its manifest chain (pure but for the licence lookup
    and, unless `data` gives them, each stage's `stage_data`): `files` are the shipped files
    SHA256SUMS lists, `prompt_example` a conversation rendered by the chat template, `own_code`
    that the folder ships the model code its config.json names (auto_map)."""
    if not chain:
        return f"# {name}\n\nNo manifest: this folder was not produced by Relay, so its history is unknown.\n"
    head = chain[0]
    stages = [m for m in reversed(chain) if trained(m)]
    data = [stage_data(m) for m in stages] if data is None else data
    reward = head.get("model_kind") == "reward"
    kind = "reward model (sequence classifier, one score)" if reward else "causal language model"
    lines = (
        front_matter(chain, gguf_type, data)
        + [
            "",
            f"# {name}",
            "",
            f"A {kind} trained with Relay: {' -> '.join(['base'] + [str(m.get('stage')) for m in stages])}.",
            "",
            "## Base model",
            "",
            base_line(chain),
            "",
        ]
        + (["## Stages", ""] if stages else [])
    )
    for m, found in zip(stages, data):
        lines += stage_section(m, found)
    use = reward_use_section(name, own_code) if reward else use_section(name, gguf_type, own_code)
    lines += prompt_section(prompt_example) + files_section(files, gguf_type) + use
    versions = head.get("versions") or {}
    lines += ["## Environment", "", ", ".join(f"{k} {v}" for k, v in versions.items()) or "unknown", ""]
    return "\n".join(lines)


LEARNED_FROM = (("teacher", "teacher it learned from"), ("reward_model", "reward model it was optimised against"))
"""The manifest records of the other models a stage learned from (its `input_models`), as the card names them."""


def stage_section(manifest: dict, found: StageData) -> list[str]:
    """The card's section on one stage: steps, figures, hyper-parameters and its data (`stage_data`)."""
    lines = [
        f"### {manifest.get('stage')}",
        "",
        f"- steps: {(manifest.get('summary') or {}).get('steps', '?')}, created {manifest.get('created', '?')}",
        f"- figures: {_figures(manifest.get('summary') or {})}",
    ]
    lines += [f"- {line}" for line in hyper_parameters(manifest.get("config") or {})]
    for key, what in LEARNED_FROM:
        record = manifest.get(key)
        if isinstance(record, dict) and record.get("path"):
            weights = f" (weights sha256 `{record['weights_hash']}`)" if record.get("weights_hash") else ""
            lines.append(f"- {what}: `{record['path']}`{weights}")
    if found.files:
        hashes = "sha256 of each file, as `sha256sum` prints it; " if found.placed else ""
        lines.append(f"- data ({hashes}{found.where}):")
        lines += [f"  - `{f}`" + (f": `{h}`" if h else "") for f, h in found.files]
    return lines + [""]


def data_notes(chain: list[dict], data: Sequence[StageData]) -> list[str]:
    """The lines export prints about the stages' data: files changed since training, paths it could not place."""
    out = []
    for m, found in zip([m for m in reversed(chain) if trained(m)], data):
        if found.stale:
            out.append(
                f"warning: {m.get('stage')}: its train files changed since it trained on them (not the manifest's "
                "data_digest); the model card says so and gives the sha256 of the files as they are now"
            )
        elif found.files and not found.placed:
            out.append(
                f"note: {m.get('stage')}: its data paths are relative to the folder it ran in, which its manifest "
                "does not record; the card shows them as written (export from that folder to give their sha256)"
            )
    return out


def prompt_section(prompt_example: Optional[str]) -> list[str]:
    if prompt_example is None:
        return []
    return [
        "## Prompt format",
        "",
        "The chat template shipped with the tokenizer (and inside model.gguf) renders a conversation "
        "as the model was trained on it; a system and a user turn, ready for the answer:",
        "",
        "```",
        prompt_example,
        "```",
        "",
    ]


def files_section(files: Sequence[str], gguf_type: Optional[str]) -> list[str]:
    lines = ["## Files", ""]
    lines += [
        f"- `{f}`" + (f": GGUF ({gguf_type}) for llama.cpp, Ollama, LM Studio" if f == GGUF_NAME else "") for f in files
    ]
    return lines + [
        "",
        f"`{CHECKSUMS}` holds the sha256 of each of them: `sha256sum -c {CHECKSUMS}` in this folder checks them.",
        "",
    ]


def _code_note(own_code: bool) -> tuple[str, list[str]]:
    """(the from_pretrained argument, the lines before the code) for a folder that ships its model code."""
    if not own_code:
        return "", []
    return ", trust_remote_code=True", [
        "The model's class is the code in this folder's `.py` files (config.json `auto_map`); "
        "`trust_remote_code=True` runs it: read it first.",
        "",
    ]


def use_section(name: str, gguf_type: Optional[str], own_code: bool = False) -> list[str]:
    trust, note = _code_note(own_code)
    lines = [
        "## Use",
        "",
        *note,
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # the Hub id, or this folder\'s path',
        f'model = AutoModelForCausalLM.from_pretrained("{name}"{trust})',
        "```",
        "",
    ]
    if not own_code:  # relay serve runs no code from a model folder
        lines += [
            "Serve it with `relay serve FOLDER` (an OpenAI-compatible /v1/chat/completions, streaming included).",
            "",
        ]
    if gguf_type:
        lines += [
            "With llama.cpp: `llama-cli -m model.gguf -cnv` (the chat template is in the file). For k-quants, "
            "quantise the file with llama.cpp's own tool: `llama-quantize model.gguf model-Q4_K_M.gguf Q4_K_M`.",
            "",
        ]
    return lines


def reward_use_section(name: str, own_code: bool = False) -> list[str]:
    """How to score a conversation as Relay's stages read this reward model: the chat template's
    text up to and including the end-of-turn token that closes the last answer
    (data_formats.render.render_scored), one score read at that last token
    (pipeline.modeling.scoring.reward_readout_index)."""
    trust, note = _code_note(own_code)
    return [
        "## Use",
        "",
        *note,
        "A conversation is scored at the end-of-turn token that closes its last answer, where Relay's RM, "
        "PPO and GRPO stages read the reward; higher is better.",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # the Hub id, or this folder\'s path',
        f'model = AutoModelForSequenceClassification.from_pretrained("{name}"{trust})',
        'messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]',
        "text = tokenizer.apply_chat_template(messages, tokenize=False)",
        "text = text[: text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]  # end at the answer's end of turn",
        'ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")',
        "with torch.no_grad():",
        "    reward = model(**ids).logits[0, 0].item()",
        "```",
        "",
        "It is a sequence classifier, not a generator: chat servers (`relay serve` too) refuse it.",
        "",
    ]


def prompt_example(folder: Path) -> Optional[str]:
    """A short conversation rendered by the folder's chat template (None without one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
