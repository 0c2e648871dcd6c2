"""Relay's decode engine: batched sampling with a static KV cache, one forward per token.

    from pipeline.modeling.decode import generate
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32, eos_ids=[2], pad_id=0, temperature=0.7)

Every place Relay samples text uses it (PPO/GRPO rollouts and their evaluations through
`pipeline.rl.generators.RelayGenerator`, the gold table, `relay chat`, `relay serve`). What
it does, and why:
- The prompts are left-padded into one batch and the KV cache is preallocated for
  `prompt + max_new_tokens` slots (transformers' `StaticCache`), so no step allocates or copies the
  cache. Position ids count each row's real tokens, so a padded row sees the positions it would
  see alone. Where every prompt opens with the same tokens (a chat template's system turn), those
  come first in every row and the padding after them (`prompt_layout`), and the prefill runs them
  once, on one row (`Decoder.prefill`).
- The attention mask of every step is a slice of one mask built up front (4D for sdpa/eager), so
  no step rebuilds it in Python.
- Each step is one forward of the last token; the next token comes from exactly softmax(logits / T)
  (one `torch.multinomial` over the batch per step, as transformers' sampling loop draws), or the
  argmax for greedy rows (T = 0); a T > 0 so small that logits / T leaves fp32's range draws from
  the limit T -> 0, the argmax (`Chooser.at_the_limit`). No logits processor touches the
  distribution: PPO and GRPO score the log-probs of exactly this distribution.
- A row ends at an eos id, at its own `max_new_tokens`, or when `on_token` says so; the call
  returns as soon as every row has ended (batch-level early exit).
- On a CPU in fp32 the linear layers run on weights prepacked for oneDNN, LoRA adapters folded into
  the packed weight and sibling projections (q/k/v, gate/up) fused into one product
  (pipeline/modeling/onednn.py): at the batch sizes of decoding that streams the weights two to
  three times as fast as the default kernel. Same math, another summation order (so logits agree
  with a plain forward to ~1e-6, not bit for bit). `RELAY_DECODE_PACKED=0` turns it off.
- The prompt is one forward of the model; each later step, for Llama/Qwen2/Mistral-shaped models,
  is the engine's own (`FastStep`: the model's modules without its forward's per-call machinery,
  attention over the slots written so far). On CUDA that step is captured once per call as a CUDA
  graph and replayed (`GraphStep`; `RELAY_DECODE_GRAPHS=0` steps with the model's forward). Other
  models step with their own forward.

LoRA models decode with the adapter active (nothing is merged into the model), and inside
`pipeline.modeling.models.adapter_disabled(model)` as the base model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from data_formats.collate import common_prefix, left_pad, shared_first_pad
from pipeline.modeling.decode_steps import FastStep, GraphStep, hf_model, step_kind
from pipeline.modeling.models import eval_mode
from pipeline.modeling.onednn import packed_linears


@dataclass
class Generation:
    """What `generate` returns, row by row in the order of the prompts."""

    tokens: list[list[int]]
    """Each row's new ids, up to and including its stop token; nothing after."""
    finished: list[bool]
    """True where the row stopped (an eos id, or `on_token` returned True); False where it ran to its
    max_new_tokens."""
    logprobs: Optional[list[list[float]]] = None
    """If requested: log softmax(logits / T_row) of each chosen token (T_row = 1 for greedy rows), from
    the logits that sampled it."""


def per_row(value, rows: int, name: str) -> list:
    """`value` as one entry per row: a scalar repeated, or a sequence of exactly `rows` entries.

    Raises:
        ValueError: a sequence of another length.
    """
    if isinstance(value, (int, float)):
        return [value] * rows
    values = list(value)
    if len(values) != rows:
        raise ValueError(f"generate: {name} has {len(values)} entries for {rows} prompts")
    return values


def check_settings(max_new: list[int], temperature: list[float], top_p: list[float]) -> None:
    """Raises ValueError naming the first setting out of range."""
    for name, values, ok, need in (
        ("max_new_tokens", max_new, lambda v: v >= 1, ">= 1"),
        ("temperature", temperature, lambda v: 0 <= v < float("inf"), ">= 0 (0 = greedy) and finite"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
    ):
        bad = [v for v in values if not ok(v)]
        if bad:
            raise ValueError(f"generate: {name} must be {need}, got {bad[0]!r}")


# ------------------------------------------------------------------------------------------
# The model side: cache, masks, one forward
# ------------------------------------------------------------------------------------------


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.2x, `past_key_values` before
    (the old name still works after the rename, with a deprecation warning on every call)."""
    return "cache" if "cache" in inspect.signature(hf_model(model).forward).parameters else "past_key_values"


def step_masks(valid: torch.Tensor, prompt_width: int, attn: str, dtype: torch.dtype):
    """(prefill mask, `mask_at(s)`: the mask of the decode step writing slot s) for a [B, L] bool
    `valid` (False at left padding): the 4D masks sdpa (bool, True = attend) and eager (additive
    float) take as they are; for any other attention the 2D [B, L] mask, from which it builds its own."""
    slots = valid.shape[1]
    if attn not in ("sdpa", "eager"):
        full = valid.long()
        return full, lambda s: full
    index = torch.arange(slots, device=valid.device)

    def as_kind(allowed: torch.Tensor) -> torch.Tensor:
        if attn == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    queries = index[:prompt_width, None]
    # A padded query slot of the prefill attends to itself only: its output is never read, and a
    # row with nothing to attend to would be NaN.
    prefill = ((index[None, :] <= queries) & valid[:, None, :]) | (index[None, :] == queries)
    return as_kind(prefill[:, None]), lambda s: as_kind((valid & (index <= s))[:, None, None, :])


SHARED_PREFIX_MIN = 16
"""The fewest leading tokens every prompt must share for the prefill to run them once (`prompt_layout`)."""


def prompt_layout(prompts: Sequence[Sequence[int]], pad_id: int, attn: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, shared): the batch `Decoder` decodes.

    Left-padded, unless there are several prompts, the attention takes a 4D mask (sdpa, eager) and
    every prompt opens with the same `shared` >= SHARED_PREFIX_MIN tokens: then each row is
    [shared tokens | padding | its own tokens]. Positions count real tokens and the masks hide the
    padding wherever it sits, so each row still sees exactly what it would alone; the shared
    tokens' keys and values are computed once (`Decoder.prefill`). The gold table's 80 prompts
    share SmolLM2's system turn and the user turn's opening, 24 of their 41 tokens on average (44 at
    most): the prefill runs 24 + 80 x 20 token positions instead of 80 x 44.

    Raises:
        ValueError: no prompts, or an empty one (`left_pad`).
    """
    seqs = [list(p) for p in prompts]
    shared = common_prefix(seqs) if len(seqs) > 1 else 0
    if shared < SHARED_PREFIX_MIN or attn not in ("sdpa", "eager"):
        return (*left_pad(seqs, pad_id), 0)
    return (*shared_first_pad(seqs, pad_id, shared), shared)


class Decoder:
    """One batch's decoding state: the cache, the masks, each row's next position. `shared`: the
    leading slots every row holds the same tokens in (`prompt_layout`; 0: none)."""

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new: int,
        kind: str = "hf",
        shared: int = 0,
    ):
        from transformers import StaticCache

        self.model, self.device, self.shared = model, input_ids.device, shared
        rows, self.prompt_width = input_ids.shape
        slots = self.prompt_width + max_new
        config = hf_model(model).config
        self.cache = StaticCache(config=config, max_cache_len=slots)
        self.cache_kw = cache_keyword(model)
        valid = torch.ones(rows, slots, dtype=torch.bool, device=self.device)
        valid[:, : self.prompt_width] = attention_mask.bool()
        dtype = next(model.parameters()).dtype
        self.prefill_mask, self.mask_at = step_masks(valid, self.prompt_width, config._attn_implementation, dtype)
        self.positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.input_ids = input_ids
        self.slot = 0
        self.fast = None
        if kind != "hf" and FastStep.supports(model, self.cache):
            fast_step = FastStep(model, self.cache, valid)
            if kind == "graph":
                self.fast = GraphStep(fast_step, rows, self.device)
            elif kind == "static":  # the graph's math without the graph (tests it on any device)
                self.fast = lambda tokens, positions, slot: fast_step.static(
                    tokens, positions, torch.tensor([slot], device=self.device)
                )
            else:
                self.fast = fast_step

    def forward(self, ids: torch.Tensor, mask, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        return out.logits[:, -1]

    def prefill(self) -> torch.Tensor:
        """Logits [B, V] after the prompt: the shared slots once (`fill_shared`), then the rest."""
        start = self.shared
        if start:
            self.fill_shared()
        logits = self.forward(
            self.input_ids[:, start:],
            self.prefill_mask[:, :, start:] if start else self.prefill_mask,
            self.positions[:, start:],
        )
        self.slot, self.positions = self.prompt_width, self.positions[:, -1:] + 1
        return logits

    def fill_shared(self) -> None:
        """Run the shared leading tokens on the first row alone and write their keys and values into
        every row's first slots (through the cache layers' own `update`, which then continues after
        them). The same math as running them in every row, one row's work instead of B."""
        from transformers import DynamicCache

        rows, n = self.input_ids.shape[0], self.shared
        one = DynamicCache()
        self.model(
            input_ids=self.input_ids[:1, :n],
            position_ids=self.positions[:1, :n],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: one},
        )
        for mine, theirs in zip(self.cache.layers, one.layers):
            mine.update(theirs.keys.expand(rows, -1, -1, -1), theirs.values.expand(rows, -1, -1, -1))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B]); logits [B, V] of the next."""
        if self.fast is not None:
            logits = self.fast(tokens, self.positions, self.slot)
        else:
            logits = self.forward(tokens[:, None], self.mask_at(self.slot), self.positions)
        self.slot, self.positions = self.slot + 1, self.positions + 1
        return logits


# ------------------------------------------------------------------------------------------
# Choosing tokens
# ------------------------------------------------------------------------------------------


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` [B, V] with each row cut to its smallest set of most likely tokens whose mass reaches
    top_p[row] (at least one token), renormalised. Rows with top_p 1 come back unchanged."""
    ordered, order = probs.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # mass of the strictly more likely tokens
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1)
    # The most likely token stays whatever top_p is: a top_p that rounds to 0 in fp32 would drop
    # every token, and 0 / 0 is NaN.
    drop[:, 0] = False
    cut = ordered.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, cut)
    return out / out.sum(-1, keepdim=True)


def near_zero_limit(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T)'s limit as T -> 0+, as logits [B, V] (pure): 0 at each row's most likely
    tokens, -inf elsewhere (all the mass on the argmax, shared between exact ties)."""
    top = logits == logits.amax(-1, keepdim=True)
    return torch.zeros_like(logits).masked_fill(~top, float("-inf"))


class Chooser:
    """Picks each row's next token from its logits: argmax where T = 0, else a draw from
    softmax(logits / T) (cut to top_p where below 1). A T so small that logits / T leaves fp32's
    range (or rounds to 0 in it) draws from the limit T -> 0, the argmax (`near_zero_limit`)."""

    def __init__(self, temperature: list[float], top_p: list[float], device, generator: Optional[torch.Generator]):
        self.greedy = torch.tensor([t == 0 for t in temperature], device=device)
        self.all_greedy, self.any_greedy = bool(self.greedy.all()), bool(self.greedy.any())
        self.temperature = torch.tensor([t if t > 0 else 1.0 for t in temperature], device=device)
        self.uniform_t = temperature[0] if len(set(temperature)) == 1 and temperature[0] > 0 else None
        self.top_p = torch.tensor(top_p, device=device)
        self.truncate = any(p < 1 for p in top_p)
        self.generator = generator
        # Only T < 1 can carry a finite logit past fp32's largest value.
        self.may_overflow = any(0 < t < 1 for t in temperature)

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        # A plain float divisor when every row shares it: the same rounding as `logits / T`.
        return logits / (self.uniform_t if self.uniform_t is not None else self.temperature[:, None])

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], logits / T_row [B, V] in fp32)."""
        logits = logits.float()
        scaled = self.scaled(logits)
        if self.all_greedy:
            return logits.argmax(-1), scaled
        probs = torch.softmax(scaled, dim=-1)
        if self.may_overflow:
            scaled, probs = self.at_the_limit(logits, scaled, probs)
        if self.truncate:
            probs = nucleus(probs, self.top_p)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return (torch.where(self.greedy, logits.argmax(-1), drawn) if self.any_greedy else drawn), scaled

    @staticmethod
    def at_the_limit(
        logits: torch.Tensor, scaled: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaled, probs) with the rows softmax turned to NaN replaced by the T -> 0 limit. Only
        an overflow makes NaN there: +inf among the scaled logits (inf - inf in softmax), or 0 / 0
        where T rounded to 0; an overflow to -inf alone is already the right probability, 0."""
        lost = probs.isnan().any(-1)
        if not bool(lost.any()):
            return scaled, probs
        scaled = torch.where(lost[:, None], near_zero_limit(logits), scaled)
        return scaled, torch.softmax(scaled, dim=-1)


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float | Sequence[float] = 1.0,
    top_p: float | Sequence[float] = 1.0,
    generator: Optional[torch.Generator] = None,
    logprobs: bool = False,
    on_token: Optional[Callable[[int, int], bool]] = None,
    on_logits: Optional[Callable[[int, torch.Tensor], None]] = None,
    min_new_tokens: int = 0,
    keep_packed: bool = True,
) -> Generation:
    """New tokens for every prompt (see the module docstring for the contract).

    `on_token(row, token)` is called for every new token of every live row, step by step; True ends
    that row after the token. `on_logits(step, logits)` sees each step's raw logits [B, V] (rows
    that have ended included), for tracing and tests. `min_new_tokens` > 0 masks the eos ids out of
    the distribution until a row has that many tokens (benchmarks compare at equal token counts).
    `keep_packed=False` keeps no prepacked weights on the model after the call
    (`pipeline.modeling.onednn.packed_linears`: the RL samplers).

    Raises:
        ValueError: no prompts, an empty prompt, or a setting out of range.
    """
    rows = len(prompts)
    max_new = per_row(max_new_tokens, rows, "max_new_tokens")
    temps, top_ps = per_row(temperature, rows, "temperature"), per_row(top_p, rows, "top_p")
    check_settings(max_new, temps, top_ps)
    device = next(model.parameters()).device
    input_ids, attention_mask, shared = prompt_layout(prompts, pad_id, hf_model(model).config._attn_implementation)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    choose = Chooser(temps, top_ps, device, generator)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    scores: Optional[list[list[float]]] = [[] for _ in range(rows)] if logprobs else None
    finished, alive = [False] * rows, [True] * rows
    with eval_mode(model), packed_linears(model, keep=keep_packed):
        decoder = Decoder(model, input_ids, attention_mask, max(max_new), kind=step_kind(model), shared=shared)
        logits = decoder.prefill()
        for step in range(max(max_new)):
            if on_logits is not None:
                on_logits(step, logits)
            if step < min_new_tokens:
                logits = logits.index_fill(-1, eos, float("-inf"))
            chosen, scaled = choose(logits)
            stops = torch.isin(chosen, eos).tolist()
            picked = chosen.tolist()
            if logprobs:
                lp = torch.log_softmax(scaled, -1).gather(1, chosen[:, None]).squeeze(1).tolist()
            for row in range(rows):
                if not alive[row]:
                    continue
                tokens[row].append(picked[row])
                if logprobs:
                    scores[row].append(lp[row])
                asked = bool(on_token(row, picked[row])) if on_token is not None else False  # every token, eos included
                stopped = bool(stops[row]) or asked
                finished[row] = stopped
                alive[row] = not stopped and len(tokens[row]) < max_new[row]
            if not any(alive):
                break
            logits = decoder.step(chosen.masked_fill(~torch.tensor(alive, device=device), pad_id))
    return Generation(tokens=tokens, finished=finished, logprobs=scores)
