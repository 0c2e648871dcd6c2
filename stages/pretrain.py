"""PT stage: continued pretraining on raw text (documents joined with EOS, packed, no cross-document attention).

    torchrun --nproc_per_node N stages/pretrain.py --config configs/pt.yaml [--train.max_steps 20]
    python stages/pretrain.py                              # one process, bundled sample data

Documents are tokenized, each followed by EOS, and cut into `train.seq_length` rows; a row's
attention stays inside each document (segment ids turned into the attention implementation's
mask or varlen lengths: pipeline/modeling/attention.py). Every token is trained except the first
of each document piece.
With `data.streaming: true` the training corpus is read lazily in file order (data_formats/streaming.py)
instead of being tokenized into memory and shuffled; resume restores the stream position.
The flow, loss normalisation, accumulation, checkpoints, resume, trackers and the final merge are
the engine's (pipeline/engine/), shared with SFT through `LanguageModelStage`.

Outputs (ARCHITECTURE.md): <output_dir>/{config.yaml, checkpoints/, runs/, adapter/, merged/,
summary.json}; merged/ is the SFT stage's base. RELAY_STOP_AFTER_STEP=k saves and exits after step k.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_formats.collate import Collator
from data_formats.drops import apply_split_policy
from data_formats.pt_data import build_pt_data
from data_formats.streaming import open_stream, stream_problems
from pipeline.config import StageConfig, TextDataConfig
from pipeline.engine.language_modeling import LanguageModelStage
from pipeline.engine.stage_main import main

log = logging.getLogger("relay.pretrain")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class PTData(TextDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/pt/train.jsonl"])
    """Raw text: JSONL/JSON/Parquet records with `text_field`, or .txt files."""
    eval: list[str] = field(default_factory=list)
    """Held-out text for eval/loss and eval/ppl. None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class PTConfig(StageConfig):
    output_dir: str = "outputs/pt"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the SFT stage's base), summary.json."""
    data: PTData = field(default_factory=PTData)


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class PTStage(LanguageModelStage):
    name = "pt"
    config_class = PTConfig

    def __init__(self, cfg: PTConfig):
        super().__init__(cfg)
        self.tasks = ["pt"]
        self.stream = None
        """The streamed training corpus (data.streaming), else None."""

    def problems(self) -> list[str]:
        data, out = self.cfg.data, []
        if data.streaming and data.record_limit is not None:
            out.append("data.max_samples: not used with data.streaming (the stream runs until train.max_steps)")
        if data.streaming and not data.eval and data.eval_fraction > 0:
            out.append(
                "data.eval_fraction: carving an eval split reads the whole corpus into memory, which "
                "data.streaming exists to avoid; give held-out files in data.eval"
            )
        return out

    def build_data(self) -> list[str]:
        """Tokenize and pack the corpus (or open its stream after a validation pass)."""
        cfg, tok = self.cfg, self.tokenizer
        seq = cfg.train.seq_length
        if cfg.data.streaming:
            self.stream = stream_train(cfg, tok)
        else:
            self.train_samples = build_pt_data(cfg.data, tok, seq, "train")
        if cfg.data.has_eval:
            self.eval_samples = build_pt_data(cfg.data, tok, seq, "eval")
        self.collator = Collator(tok.pad_token_id, "pack", seq, cfg.model.attn_implementation)
        problems = (
            [] if cfg.data.streaming else self.fill_problems(len(self.train_samples), f"packed row(s) of {seq} tokens")
        )
        if problems:
            return problems
        rows = "streamed training rows" if cfg.data.streaming else f"{len(self.train_samples)} training row(s)"
        log.info("pt: %s, %d eval row(s) of %d tokens", rows, len(self.eval_samples), seq)
        return []

    def micro_batches(self) -> list[dict]:
        """From the stream: every rank reads the same rows and keeps every world_size-th from its
        own rank on, so the global batch is the same whatever the number of processes."""
        if self.stream is None:
            return super().micro_batches()
        t, acc = self.cfg.train, self.accelerator
        batches = []
        for _ in range(t.grad_accum):
            rows = [self.stream.next_row() for _ in range(t.batch_size * acc.num_processes)]
            batches.append(
                self.collate(self.collator, rows[acc.process_index :: acc.num_processes], range(t.batch_size))
            )
        return batches

    def manifest_extras(self) -> dict:
        """A weighted stream's mix (data.weights), as an in-memory mix records it."""
        mix = self.stream.describe() if self.stream is not None else {}
        return {"data_mix": mix} if mix else {}

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()} if self.stream is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])


def stream_train(cfg: PTConfig, tokenizer):
    """The streamed training corpus, after one pass that reads (without keeping) every record so
    bad ones are reported together before training, as for an in-memory corpus.

    Raises:
        DataError: bad records with on_error='strict' (outside drops.collect_refusals).
    """
    data = cfg.data
    apply_split_policy(
        stream_problems(
            data.train, fmt=data.format, text_field=data.text_field, max_record_bytes=data.max_record_bytes
        ),
        data.on_error,
        "pt train data (streamed)",
    )
    return open_stream(data, tokenizer, cfg.train.seq_length, cfg.train.seed)


if __name__ == "__main__":
    raise SystemExit(main(PTStage))
