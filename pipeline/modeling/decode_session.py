"""Decoding kept across turns: one batch's KV cache that later calls extend instead of rebuilding.

    session = DecodeSession(model, rows=4, eos_ids=[2], pad_id=0, temperature=0.7)
    first = session.generate([0, 1, 2, 3], prompts, [64] * 4)
    later = session.generate([1, 3], [prompts[1] + first[1] + result_1, ...], [40, 40])

A tool rollout (pipeline/rl/tool_rollout.py) samples a turn, inserts the tool results and
samples again. Through `decode.generate` every later turn is a fresh call that prefills the whole
conversation again (prompt, earlier turns, results); here each row's cached tokens stay, and a call
feeds only what the row's context adds to them (the turn's stop token, which sampling never feeds,
and the inserted ids), as one forward, then decodes as `decode.generate` does.

What it samples is what `decode.generate(model, contexts, ...)` samples for the same rows: the
same distribution (softmax(logits / T), logits within ~1e-6: another summation order), drawn from
the same RNG in the same order (one draw per listed row per step, the listed rows in the order
given, until all of them end, as a fresh call over exactly those rows draws).

The cache layout: one column per forward position, shared by all rows (a static cache writes a
column of every row at once), and a [rows, slots] `valid` mask saying which cells hold a row's
real tokens. A row that is idle in a call (not listed, or ended) writes pad ids into cells marked
invalid; a listed row's new ids are right-aligned in the call's first columns, so every row's
next-token logits come from the same column. Position ids count each row's real tokens, so a row
sees the positions and keys it would see alone. When a row's context is not an extension of its
cached tokens (a caller that replaced them), the cells past the common prefix are invalidated and
the rest is fed again. The cache grows (a copy) when a call needs more columns than it has.

Models: the ones whose cache layers are plain `StaticLayer`s with sdpa or eager attention
(`supported`); the decode steps are `decode.Decoder`'s (`FastStep`, `GraphStep` or the model's own
forward).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from pipeline.modeling.decode import Chooser, cache_keyword, check_settings, per_row
from pipeline.modeling.decode_steps import FastStep, GraphStep, hf_model, step_kind
from pipeline.modeling.models import eval_mode
from pipeline.modeling.onednn import packed_linears


def supported(model: torch.nn.Module) -> bool:
    """A model whose cache a session can keep: full attention in every layer (plain static cache
    layers, which the session copies when it grows) and sdpa or eager attention (4D masks, which
    can hold the gaps idle rows leave)."""
    config = hf_model(model).config
    if config._attn_implementation not in ("sdpa", "eager"):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    return all(t == "full_attention" for t in (getattr(config, "layer_types", None) or []))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def window_mask(valid: torch.Tensor, start: int, width: int, attn: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask [B, 1, width, slots] of queries at columns start..start+width-1: each attends to
    its row's valid cells up to itself, and to itself (a query at an invalid cell is never read; a
    row with nothing to attend to would be NaN, and its keys would poison later reads)."""
    index = torch.arange(valid.shape[1], device=valid.device)
    queries = index[start : start + width, None]
    allowed = ((index[None, :] <= queries) & valid[:, None, :]) | (index[None, :] == queries)
    if attn == "sdpa":
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, torch.finfo(dtype).min)[
        :, None
    ]


class DecodeSession:
    """A batch of `rows` conversations decoded across several calls on one kept KV cache (module
    docstring). The model's weights must not change between the calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        temperature: float = 1.0,
        generator: Optional[torch.Generator] = None,
        logprobs: bool = False,
        keep_packed: bool = False,
        kind: Optional[str] = None,
    ):
        self.kind = kind
        """The decode step (`decode.step_kind`'s names, or 'static': the CUDA graph's step uncaptured,
        which tests run on a CPU); None: `decode.step_kind(model)`."""
        self.model, self.rows, self.pad_id, self.temperature = model, rows, pad_id, temperature
        self.device = next(model.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=self.device)
        self.generator, self.keep_packed = generator, keep_packed
        self.context: list[list[int]] = [[] for _ in range(rows)]
        """Each row's ids whose keys and values the cache holds, in order."""
        self.columns: list[list[int]] = [[] for _ in range(rows)]
        """The cache column of each of them."""
        self.logprobs: Optional[list[list[float]]] = [[] for _ in range(rows)] if logprobs else None
        """If asked: log softmax(logits / T) of every token sampled for each row, across calls."""
        self.cache, self.valid, self.capacity, self.slot, self.step = None, None, 0, 0, None
        config = hf_model(model).config
        self.attn, self.config, self.cache_kw = config._attn_implementation, config, cache_keyword(model)

    # -- the cache ---------------------------------------------------------------------------

    def _reserve(self, columns: int) -> None:
        """Room for `columns` more columns: a larger cache with the written ones copied over."""
        from transformers import StaticCache

        need = self.slot + columns
        if need <= self.capacity:
            return
        cache = StaticCache(config=self.config, max_cache_len=need)
        valid = torch.zeros(self.rows, need, dtype=torch.bool, device=self.device)
        if self.cache is not None:
            valid[:, : self.slot] = self.valid[:, : self.slot]
            for old, new in zip(self.cache.layers, cache.layers):
                if old.is_initialized:
                    new.lazy_initialization(old.keys, old.values)
                    new.keys[:, :, : self.slot] = old.keys[:, :, : self.slot]
                    new.values[:, :, : self.slot] = old.values[:, :, : self.slot]
                    new.cumulative_length.fill_(self.slot)
        self.cache, self.valid, self.capacity = cache, valid, need
        self.step = None  # the fast step holds the old cache: made again on first use

    def _stepper(self) -> Optional[Callable]:
        """The decode step `decode.Decoder` would use on this cache (None: the model's forward),
        decided once the first forward has initialised the cache's layers."""
        if self.step is None and all(layer.is_initialized for layer in self.cache.layers):
            kind = self.kind or step_kind(self.model)
            if kind != "hf" and FastStep.supports(self.model, self.cache):
                fast = FastStep(self.model, self.cache, self.valid)
                self.step = GraphStep(fast, self.rows, self.device) if kind == "graph" else fast
                if kind == "static":
                    self.step = lambda tokens, positions, slot: fast.static(
                        tokens, positions, torch.tensor([slot], device=self.device)
                    )
            else:
                self.step = False
        return self.step or None

    def _truncate(self, row: int, keep: int) -> None:
        """Forget `row`'s cached tokens past the first `keep` (their cells become invalid)."""
        if keep < len(self.context[row]):
            self.valid[row, self.columns[row][keep:]] = False
            del self.context[row][keep:], self.columns[row][keep:]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """Logits [B, V] of the last of `width` columns fed through the model's forward."""
        mask = window_mask(self.valid, self.slot, width, self.attn, next(self.model.parameters()).dtype)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1]

    def _feed(self, new: dict[int, list[int]], width: int) -> torch.Tensor:
        """Feed each row its `new` ids, right-aligned in the next `width` columns; every other cell
        of those columns is invalid. Logits [B, V] after each row's last id."""
        ids = torch.full((self.rows, width), self.pad_id, dtype=torch.long)
        positions = torch.zeros((self.rows, width), dtype=torch.long)
        for row, fed in new.items():
            first = self.slot + width - len(fed)
            ids[row, width - len(fed) :] = torch.tensor(fed, dtype=torch.long)
            positions[row, width - len(fed) :] = torch.arange(len(self.context[row]), len(self.context[row]) + len(fed))
            self.valid[row, first : self.slot + width] = True
            self.context[row] += fed
            self.columns[row] += range(first, self.slot + width)
        step = self._stepper() if width == 1 else None
        ids, positions = ids.to(self.device), positions.to(self.device)
        logits = step(ids[:, 0], positions, self.slot) if step is not None else self._forward(ids, positions, width)
        self.slot += width
        return logits

    # -- the calls ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        rows: Sequence[int],
        contexts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        on_logits: Optional[Callable[[int, torch.Tensor], None]] = None,
    ) -> list[list[int]]:
        """New ids for each listed row given its whole context so far (its prompt and everything
        since): `decode.generate(model, contexts, ...)`'s tokens for those rows, each up to and
        including its stop token. The first call must list every row. `on_logits(step, logits)`
        sees the listed rows' logits [len(rows), V] before each draw (a benchmark may edit them
        in place to force tokens).

        Raises:
            ValueError: the first call leaves a row out, an empty context, a repeated row, or a
                setting out of range.
        """
        rows = list(rows)
        max_new = per_row(max_new_tokens, len(rows), "max_new_tokens")
        check_settings(max_new, [self.temperature] * len(rows), [1.0] * len(rows))
        if len(set(rows)) != len(rows) or len(contexts) != len(rows) or any(not c for c in contexts):
            raise ValueError("DecodeSession.generate: each listed row once, with a non-empty context")
        if self.cache is None and sorted(rows) != list(range(self.rows)):
            raise ValueError(
                "DecodeSession.generate: the first call must list every row (an idle row needs a cached token)"
            )
        new = {}
        for row, context in zip(rows, contexts):
            self._truncate(row, min(common_prefix(self.context[row], context), len(context) - 1))  # >= 1 id to feed
            new[row] = list(context[len(self.context[row]) :])
        width = max(len(ids) for ids in new.values())
        self._reserve(width + max(max_new))
        with eval_mode(self.model), packed_linears(self.model, keep=self.keep_packed):
            return self._decode(rows, max_new, self._feed(new, width), on_logits)

    def _decode(self, rows: list[int], max_new: list[int], logits: torch.Tensor, on_logits) -> list[list[int]]:
        """`decode.generate`'s loop over the listed rows (the others idle)."""
        index = torch.tensor(rows, device=self.device)
        choose = Chooser([self.temperature] * len(rows), [1.0] * len(rows), self.device, self.generator)
        tokens: list[list[int]] = [[] for _ in rows]
        alive = [True] * len(rows)
        for step in range(max(max_new)):
            listed = logits.index_select(0, index)
            if on_logits is not None:
                on_logits(step, listed)
            chosen, scaled = choose(listed)
            stops, picked = torch.isin(chosen, self.eos).tolist(), chosen.tolist()
            if self.logprobs is not None:
                lp = torch.log_softmax(scaled, -1).gather(1, chosen[:, None]).squeeze(1).tolist()
            for i, row in enumerate(rows):
                if not alive[i]:
                    continue
                tokens[i].append(picked[i])
                if self.logprobs is not None:
                    self.logprobs[row].append(lp[i])
                alive[i] = not stops[i] and len(tokens[i]) < max_new[i]
            if not any(alive):
                break
            logits = self._feed({row: [picked[i]] for i, row in enumerate(rows) if alive[i]}, 1)
        return tokens
