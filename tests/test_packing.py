"""Packing is contamination-free (segment ids turned into a block-causal 4D mask on the model's
side + restarting positions) on sdpa and eager, padding does not change per-sample loss, and PT
rows keep documents apart. Every implementation and batch size: tests/test_packing_attention.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from data_formats.collate import Collator, left_pad, pack, packing_efficiency
from data_formats.pt_data import chunk_documents
from pipeline.engine.steps import model_inputs
from pipeline.modeling.attention import block_causal_mask

SEQ = 24
A = {"input_ids": [5, 17, 99, 230, 41, 8, 77], "labels": [-100, -100, -100, 230, 41, 8, 77], "task_id": 0}
B = {
    "input_ids": [64, 12, 300, 88, 19, 45, 61, 9, 2],
    "labels": [-100, -100, -100, -100, 19, 45, 61, 9, 2],
    "task_id": 1,
}
C = {"input_ids": [7, 8, 9, 10], "labels": [-100, 8, 9, 10], "task_id": 0}


def _model(path, attn):
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def _per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the supervised positions of one sequence."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)


def _forward(model, batch):
    """Logits of `batch` as the training steps run it (a packed batch's attention built from its
    segment ids for `model`'s implementation)."""
    with torch.no_grad():
        return model(**model_inputs(batch, model), use_cache=False).logits


def test_pack_layout():
    rows = pack([A, B, C, A], SEQ)
    # Balanced: rows of 14 and 13 tokens (in order, 20 and 7: a batch padded to 20).
    assert [r["lengths"] for r in rows] == [[7, 7], [9, 4]] and [r["samples"] for r in rows] == [[0, 3], [1, 2]]
    assert rows[0]["labels"][7] == -100 and rows[1]["labels"][9] == -100  # first token of the 2nd A, of C
    batch = Collator(0, "pack", SEQ)(rows)
    # Padded to the longest row (14 tokens), not to seq_length (24).
    assert batch["input_ids"].shape == (2, 14) and "attention_mask" not in batch
    assert batch["input_ids"][1].tolist() == B["input_ids"] + C["input_ids"] + [0]
    assert batch["segment_ids"].tolist() == [
        [0] * 7 + [1] * 7,
        [0] * 9 + [1] * 4 + [2],
    ]  # the padding tail: its own
    assert batch["position_ids"][0].tolist() == list(range(7)) * 2
    assert batch["position_ids"][1].tolist()[:13] == list(range(9)) + list(range(4))
    assert batch["task_ids"][0].tolist() == [0] * 14
    assert batch["task_ids"][1].tolist() == [1] * 9 + [0] * 4 + [-1] and batch["labels"][1, 13:].tolist() == [-100]
    assert packing_efficiency(rows, SEQ) == pytest.approx(27 / 48)
    mask = block_causal_mask(batch["segment_ids"])[1, 0]
    assert mask[10].tolist() == [False] * 9 + [True, True] + [False] * 3  # C's 2nd token: C's first two only
    for attn in ("flash_attention_2", "flex_attention", "eager"):  # the same batch for every implementation
        other = Collator(0, "pack", SEQ, attn_implementation=attn)(rows)
        assert other.keys() == batch.keys() and all(torch.equal(other[k], batch[k]) for k in batch)
    with pytest.raises(ValueError, match="packing needs"):
        pack([{"input_ids": list(range(SEQ + 1))}], SEQ)


def _in_order_slots(lengths: list[int], seq: int) -> int:
    """Rows x longest row of the previous packing: samples in order until the next does not fit."""
    rows: list[int] = []
    for n in lengths:
        if not rows or rows[-1] + n > seq:
            rows.append(0)
        rows[-1] += n
    return len(rows) * max(rows)


def test_packing_never_pads_more_than_in_order_and_keeps_every_sample_once():
    generator = torch.Generator().manual_seed(0)
    balanced = in_order = 0
    for trial in range(300):
        seq = int(torch.randint(8, 200, (1,), generator=generator))
        count = int(torch.randint(1, 17, (1,), generator=generator))
        lengths = torch.randint(1, seq + 1, (count,), generator=generator).tolist()
        samples = [{"input_ids": [trial + k] * n} for k, n in enumerate(lengths)]
        rows = pack(samples, seq)
        assert sorted(i for r in rows for i in r["samples"]) == list(range(count))
        for r in rows:
            assert r["samples"] == sorted(r["samples"]) and sum(r["lengths"]) == len(r["input_ids"]) <= seq
            assert r["input_ids"] == [x for i in r["samples"] for x in samples[i]["input_ids"]]
        assert [r["samples"][0] for r in rows] == sorted(r["samples"][0] for r in rows)
        slots = len(rows) * max(len(r["input_ids"]) for r in rows)
        reference = _in_order_slots(lengths, seq)
        assert slots <= reference
        balanced, in_order = balanced + slots, in_order + reference
    assert balanced < 0.9 * in_order  # the point of balancing: less padding over many batches


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_are_contamination_free(tiny_model_dir, attn):
    model = _model(tiny_model_dir, attn)
    collate = Collator(0, "pack", SEQ, attn_implementation=attn)
    packed = collate(pack([A, B], SEQ))
    a_changed = dict(A, input_ids=[1000 + x for x in A["input_ids"]])
    perturbed = collate(pack([a_changed, B], SEQ))
    logits, logits_p = _forward(model, packed), _forward(model, perturbed)
    b = slice(7, 16)
    assert not torch.equal(logits[0, :7], logits_p[0, :7])  # A's change is visible to A
    assert torch.equal(logits[0, b], logits_p[0, b])  # ...but bitwise invisible to B
    for sample, span in ((A, slice(0, 7)), (B, b)):
        alone = _forward(model, {"input_ids": torch.tensor([sample["input_ids"]])})[0]
        packed_loss = _per_sample_loss(logits[0, span], packed["labels"][0, span])
        alone_loss = _per_sample_loss(alone, torch.tensor(sample["labels"]))
        assert abs(packed_loss.item() - alone_loss.item()) < 1e-5


def test_position_ids_alone_leak_on_sdpa(tiny_model_dir):
    """Negative control: without the segment ids (so no block mask), B sees A (so the test above can
    fail). With a cache transformers does not look for packing in the position ids."""
    model = _model(tiny_model_dir, "sdpa")
    collate = Collator(0, "pack", SEQ)
    packed = collate(pack([A, B], SEQ))
    perturbed = collate(pack([dict(A, input_ids=[1000 + x for x in A["input_ids"]]), B], SEQ))
    for batch in (packed, perturbed):
        del batch["segment_ids"]
    with torch.no_grad():
        logits, logits_p = (model(**model_inputs(b)).logits for b in (packed, perturbed))
    assert not torch.equal(logits[0, 7:16], logits_p[0, 7:16])


def test_right_padding_keeps_per_sample_loss(tiny_model_dir):
    model = _model(tiny_model_dir, "sdpa")
    batch = Collator(0, "padding")([A, B, C])
    assert batch["attention_mask"].sum(1).tolist() == [7, 9, 4]
    assert batch["task_ids"][2].tolist() == [0] * 4 + [-1] * 5
    logits = _forward(model, batch)
    for i, sample in enumerate((A, B, C)):
        n = len(sample["input_ids"])
        alone = _forward(model, {"input_ids": torch.tensor([sample["input_ids"]])})[0]
        padded = _per_sample_loss(logits[i, :n], batch["labels"][i, :n])
        assert abs(padded.item() - _per_sample_loss(alone, torch.tensor(sample["labels"])).item()) < 1e-5
        assert _per_sample_loss(logits[i], batch["labels"][i]).item() == pytest.approx(padded.item(), abs=1e-5)


def test_pt_rows_keep_documents_apart(tiny_model_dir):
    docs = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    rows = chunk_documents(docs, eos_id=2, seq_length=8)
    assert [r["input_ids"] for r in rows] == [
        [11, 12, 13, 14, 15, 2, 21, 22],
        [23, 2, 31, 32, 33, 34, 35, 36],
        [37, 38, 39, 40, 2],
    ]
    assert [r["lengths"] for r in rows] == [[6, 2], [2, 6], [5]]
    assert rows[1]["labels"] == [-100, 2, -100, 32, 33, 34, 35, 36]
    model = _model(tiny_model_dir, "sdpa")
    collate = Collator(0, "pack", 8)
    base = _forward(model, collate(rows[:2]))
    other = [dict(rows[0], input_ids=[100] * 6 + [21, 22])] + rows[1:2]
    changed = _forward(model, collate(other))
    assert torch.equal(base[0, 6:], changed[0, 6:]) and not torch.equal(base[0, :6], changed[0, :6])


def test_pt_rows_never_train_nothing():
    # A document that fills its row leaves its EOS alone in the next one, with nothing before it
    # to predict it from: such a row would be a step of zero loss (an optimizer step on nothing).
    assert [r["input_ids"] for r in chunk_documents([[11, 12, 13]], eos_id=2, seq_length=3)] == [[11, 12, 13]]
    rows = chunk_documents([[11, 12, 13], [21, 22]], eos_id=2, seq_length=3)
    assert [r["input_ids"] for r in rows] == [[11, 12, 13], [2, 21, 22]]  # no row [2] after it
    assert rows[1]["labels"] == [-100, -100, 22]


def test_left_pad_and_mask_kinds():
    ids, mask = left_pad([[4, 5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[4, 5, 6], [0, 0, 7]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    segments = torch.tensor([[0, 0, 1]])
    eager = block_causal_mask(segments, "eager")[0, 0]
    assert eager.dtype == torch.float32 and eager[2, 1].item() == torch.finfo(torch.float32).min and eager[1, 0] == 0
    with pytest.raises(ValueError, match="flash_attention_2"):
        block_causal_mask(segments, "flash_attention_2")
    with pytest.raises(ValueError, match="needs the model"):
        model_inputs(Collator(0, "pack", SEQ)(pack([A, C], SEQ)))
    with pytest.raises(ValueError, match="need padding_mode='pack'"):
        Collator(0, "padding")(pack([A, C], SEQ))
