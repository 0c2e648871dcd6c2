"""The engine's held-out loop (pipeline/engine/held_out.py): every rank runs as many batches, a short
rank's padding batch runs and counts as zeros, so the ranks' sums are one process's sums for any
number of held-out samples. On two real ranks: tests/test_cells_ddp.py (uneven held-out sets)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.held_out import eval_shards, held_out, ratio

VALUES = torch.arange(1.0, 12.0, dtype=torch.float64) ** 1.5


class Ranks:
    """A stand-in accelerator that counts its all-reduces (the reduction itself is the test's)."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self):
        self.reduces = 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reduces += 1
        return tensor


def figures(calls: list):
    def of(indices):
        calls.append(list(indices))
        picked = VALUES[list(indices)]
        return {"n": len(indices), "value": picked.sum(), "pair": torch.stack([picked.sum(), (picked**2).sum()])}

    return of


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("n", range(1, 10))
def test_the_ranks_sums_are_one_process_sums(n, batch, world):
    one = held_out(eval_shards(n, batch * world, 1, 0), figures([]), None)
    per_rank, forwards = [], []
    for rank in range(world):
        calls: list = []
        per_rank.append(held_out(eval_shards(n, batch, world, rank), figures(calls), None))
        forwards.append(len(calls))
    assert len(set(forwards)) == 1  # every rank ran as many forwards (padding batches included)
    for key in one:
        total = sum(r[key] for r in per_rank)
        assert torch.allclose(total, one[key], rtol=1e-12), key
    assert float(one["n"]) == n
    assert ratio(one, "value", "n") == pytest.approx(float(VALUES[:n].mean()), rel=1e-12)


def test_a_padding_batch_runs_counts_zero_and_one_all_reduce_carries_every_figure():
    calls: list = []
    acc = Ranks()
    sums = held_out(eval_shards(5, 2, 2, 1), figures(calls), acc)  # rank 1 of 2 holds samples 1 and 3
    assert calls == [[1, 3], [0, 1]]  # its second batch is padding: it runs (a sharded forward needs every rank)
    assert float(sums["n"]) == 2 and float(sums["value"]) == float(VALUES[1] + VALUES[3])
    assert sums["pair"].shape == (2,) and sums["pair"].dtype == torch.float64
    assert acc.reduces == 1


def test_no_counted_sample_gives_nan_not_an_error():
    sums = held_out([([0], False)], figures([]), None)
    assert ratio(sums, "value", "n") != ratio(sums, "value", "n")  # NaN
    assert ratio({}, "value", "n") != ratio({}, "value", "n")


def test_distill_evaluates_every_ranks_share_through_the_loop():
    """The distill stage's eval/kl is a token mean over every rank's held-out prompts (it returned
    nothing on more than one rank before): rank 1 of 2 counts its own prompts 1 and 3, not its
    padding batch, and hands its sums to the one all-reduce."""
    from types import SimpleNamespace as NS

    from pipeline.engine.stage import Stage
    from stages.distill import DistillStage

    acc = Ranks()
    acc.process_index = 1
    stage = NS(
        eval_samples=list(range(5)),
        cfg=NS(train=NS(batch_size=2, eval_batches=None, seed=0)),
        accelerator=acc,
        rollout=lambda prompts: prompts,
        token_losses=lambda rollout, rows, grad: (None, torch.tensor([float(p) ** 2 for p in rollout]), None),
    )
    stage.held_out = lambda figures: Stage.held_out(stage, figures)
    assert DistillStage.evaluate(stage) == {"eval/kl": 5.0, "eval/loss": 5.0}  # (1 + 9) / 2
    assert acc.reduces == 1


def test_a_cap_takes_batches_spread_over_the_set_on_every_rank():
    """`max_batches` below the number of batches: that many, the first and then evenly apart (a
    file grouped by task is sampled across its tasks), the same batch numbers on every rank, and
    a rank's padding batch still counts nothing."""
    assert [idx for idx, _ in eval_shards(12, 2, 1, 0, 3)] == [[0, 1], [4, 5], [8, 9]]
    assert [idx for idx, _ in eval_shards(12, 2, 1, 0, 1)] == [[0, 1]]
    assert len(eval_shards(12, 2, 1, 0, 9)) == 6  # a cap above the set takes it all
    ranks = [eval_shards(9, 2, 2, r, 2) for r in range(2)]  # rank 0: 0 2 | 4 6 | 8; rank 1: 1 3 | 5 7 | pad
    assert ranks[0] == [([0, 2], True), ([4, 6], True)] and ranks[1] == [([1, 3], True), ([5, 7], True)]
    assert eval_shards(5, 2, 2, 1, 2)[1] == ([0, 1], False)  # rank 1's second batch (of two) is its padding
