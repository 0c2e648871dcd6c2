"""FSDP2's private fields across torch versions (pipeline/engine/fsdp.py): the parameter groups of a
unit as torch with per-parameter meshes keeps them (`_fsdp_param_groups`, a list) and as torch before
it does (`_fsdp_param_group`, one group or None), and a torch without what the engine needs named up
front with the versions it supports. Stand-in objects play the older torch: no second torch here."""

from __future__ import annotations

import re

import pytest
import torch

from pipeline.engine import fsdp


class Group:
    """An FSDPParamGroup's two fields `gathered` reads and restores."""

    def __init__(self, info):
        self.is_unsharded = False
        self.post_forward_mesh_info = info


class OldState:
    """FSDPState before per-parameter meshes: one group (None for a unit without parameters)."""

    def __init__(self, group):
        self._fsdp_param_group = group


class NewState:
    def __init__(self, groups):
        self._fsdp_param_groups = groups

    @property
    def _fsdp_param_group(self):  # torch keeps it, refusing more than one group
        raise AssertionError("Expected at most 1 param group")


class Unit:
    """An FSDPModule's calls `gathered` makes, recorded."""

    def __init__(self, state):
        self.state, self.calls = state, []
        self.groups = state.__dict__.get("_fsdp_param_groups") or [state.__dict__.get("_fsdp_param_group")]

    def _get_fsdp_state(self):
        return self.state

    def set_reshard_after_forward(self, value, recurse=True):
        self.calls.append(("reshard_after_forward", value, recurse))
        for group in self.groups:
            group.post_forward_mesh_info = None  # what torch's setter does for False

    def unshard(self):
        self.calls.append("unshard")
        for group in self.groups:
            group.is_unsharded = True

    def reshard(self):
        self.calls.append("reshard")
        for group in self.groups:
            group.is_unsharded = False


def test_param_groups_reads_either_layout_and_names_the_supported_torch_otherwise():
    one, two = Group("a"), Group("b")
    assert fsdp.param_groups(OldState(one)) == [one]
    assert fsdp.param_groups(OldState(None)) == []  # a unit that holds no parameters
    assert fsdp.param_groups(NewState([one, two])) == [one, two]  # the list first: the property refuses two
    with pytest.raises(
        RuntimeError,
        match=rf"torch {re.escape(torch.__version__)}: an FSDP2 unit's state has neither "
        r"_fsdp_param_groups nor _fsdp_param_group; .*supports torch 2\.8 or newer",
    ):
        fsdp.param_groups(object())


@pytest.mark.parametrize("layout", ["old", "new"])
def test_gathered_unshards_and_restores_each_unit_on_either_layout(layout, monkeypatch):
    groups = [Group("mesh-a"), Group("mesh-b")]
    states = (
        [OldState(groups[0]), OldState(groups[1])] if layout == "old" else [NewState(groups[:1]), NewState(groups[1:])]
    )
    units = [Unit(state) for state in states]
    monkeypatch.setattr(fsdp, "_units", lambda model: units)
    with fsdp.gathered(torch.nn.Linear(2, 2)):
        assert all(g.is_unsharded and g.post_forward_mesh_info is None for g in groups)
    assert [g.post_forward_mesh_info for g in groups] == ["mesh-a", "mesh-b"] and not any(
        g.is_unsharded for g in groups
    )
    assert all(u.calls == [("reshard_after_forward", False, False), "unshard", "reshard"] for u in units)


def test_a_torch_without_fsdp2s_setter_is_named_before_anything_shards(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    assert fsdp.unsupported_torch() is None  # this torch
    monkeypatch.delattr(FSDPModule, "set_reshard_after_forward")
    expected = (
        f"distributed.engine: fsdp needs torch 2.8 or newer (FSDPModule.set_reshard_after_forward); "
        f"this is torch {torch.__version__}: upgrade torch, or use distributed.engine ddp"
    )
    assert fsdp.unsupported_torch() == expected
    with pytest.raises(RuntimeError) as err:
        fsdp.shard_model(torch.nn.Linear(2, 2), torch.device("cpu"), sharding="FULL_SHARD", mixed="no")
    assert str(err.value) == expected


FSDP_HELD_OUT = r"""
import sys
import torch
from pipeline.engine import fsdp
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=32)
model = fsdp.shard_model(LlamaForCausalLM(config), torch.device("cpu"), sharding="FULL_SHARD", mixed="no")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
optimizer.zero_grad()
with torch.no_grad():
    model.eval()
    model(input_ids=ids)  # a held-out forward: the root unit keeps its weights gathered after it
    model.train()
state = fsdp.optimizer_state(model, optimizer)
print("OK", len(state["state"]))
"""


def test_optimizer_state_after_a_held_out_forward(tmp_path):
    """A held-out evaluation's plain forward leaves the root unit (reshard_after_forward=False)
    gathered, and the optimizer's sharded parameters no longer map onto the model's: the checkpoint
    after it failed with KeyError 0, a full-weight FSDP run losing its final checkpoint."""
    import subprocess
    import sys

    script = tmp_path / "held_out.py"
    script.write_text(FSDP_HELD_OUT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])},
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
