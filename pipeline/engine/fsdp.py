"""FSDP2 (`torch.distributed.fsdp.fully_shard`): the trained module sharded over every rank, on
CPU (gloo) and CUDA (nccl) through the same calls.

Not through accelerate: accelerate 1.15 turns its FSDP plugin (fsdp_version 1 or 2) on only for
GPU-type devices, and on CPU runs plain DDP without a word (measured: `Accelerator(cpu=True,
fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))` under torchrun reports
MULTI_CPU). So the accelerator keeps its process group, device, accumulation counter and
collectives, and the model is sharded here and never given to `accelerator.prepare`.

Layout: every transformer block (the classes a transformers model lists in `_no_split_modules`)
is one unit; the rest (embeddings, final norm, heads: a tied embedding and head must share a
unit) belongs to the root, the module the stage trains (PPO's and GRPO's actor-critic holds
the policy's and the critic's). The root's weights are whole only inside the root's forward, so
every call that bypasses it (PPO's and GRPO's sampling and scoring, the critic's per-token
head) runs inside `gathered`. A LoRA adapter lives in the block it adapts, so it is sharded with
it (FSDP2 allows frozen and trainable parameters in one unit). Frozen copies outside
`parameters()` (PPO's and GRPO's reference and reward models under full fine-tuning) stay
whole on every rank.

Outside a unit's forward its parameters are DTensor shards: whoever reads them as tensors
gathers first (`gathered`), and `module.state_dict()` always yields shards (FSDP2 reshards in a
state-dict hook), so checkpoints and exports gather through `full_state` / `full_tensors`.

Supported torch: 2.8 and newer (`fully_shard` public in `torch.distributed.fsdp` from 2.6,
`FSDPModule.set_reshard_after_forward` from 2.8: not in 2.7.0's wheel); `unsupported_torch` says so before a run.
Private fields read here: a unit state's parameter groups (`param_groups`: the list
`_fsdp_param_groups` where torch has per-parameter meshes, the single `_fsdp_param_group`
before), a group's `is_unsharded` and `post_forward_mesh_info`, and the state's `_lazy_init`.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

SUPPORTED_TORCH = "2.8 or newer"
"""The torch versions whose FSDP2 this module is written against (see the module docstring)."""

SHARDING = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
"""distributed.fsdp_sharding -> fully_shard's reshard_after_forward (FSDP1's names: FULL_SHARD
frees a block's gathered weights after its forward, SHARD_GRAD_OP keeps them to the backward)."""


def unsupported_torch() -> Optional[str]:
    """Why this torch cannot run distributed.engine fsdp, in one line; None when it can. Asks for
    the features, not the version number (a nightly or a vendor build carries its own)."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        return (
            f"distributed.engine: fsdp needs torch {SUPPORTED_TORCH} (FSDP2's fully_shard in torch.distributed.fsdp); "
            f"this is torch {torch.__version__}: upgrade torch, or use distributed.engine ddp"
        )
    if not hasattr(FSDPModule, "set_reshard_after_forward"):
        return (
            f"distributed.engine: fsdp needs torch {SUPPORTED_TORCH} (FSDPModule.set_reshard_after_forward); "
            f"this is torch {torch.__version__}: upgrade torch, or use distributed.engine ddp"
        )
    return None


def param_groups(state) -> list:
    """A unit's FSDP parameter groups (FSDPState, private). torch with per-parameter meshes keeps a
    list, `_fsdp_param_groups`; torch before it one group or None, `_fsdp_param_group` (still there
    later as a property that refuses more than one group, so the list is read first).

    Raises:
        RuntimeError: the state has neither field (a torch this module was not written against).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        f"torch {torch.__version__}: an FSDP2 unit's state has neither _fsdp_param_groups nor "
        f"_fsdp_param_group; pipeline/engine/fsdp.py supports torch {SUPPORTED_TORCH}"
    )


def is_sharded(model: Optional[torch.nn.Module]) -> bool:
    """Whether `model` (or a module inside it) was sharded by `shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return model is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def runs_unwrapped(accelerator, model: torch.nn.Module) -> bool:
    """One process, and no engine wraps or shards `model` (no accelerator: a test or a notebook):
    its submodules may be called directly, and a module may run twice before a backward."""
    from accelerate.utils import DistributedType

    return accelerator is None or (accelerator.distributed_type == DistributedType.NO and not is_sharded(model))


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `shard_model` shards before the root: every transformer block (the classes of
    the transformers models inside `model` list as `_no_split_modules`)."""
    from transformers import PreTrainedModel

    block_names: set[str] = set()
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            block_names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in block_names]


def shard_model(model: torch.nn.Module, device: torch.device, *, sharding: str, mixed: str) -> torch.nn.Module:
    """Shard `model` in place over every rank (one rank: a mesh of one, the same code path).

    `mixed` is accelerate's mixed_precision: bf16/fp16 gather the weights in that dtype and
    reduce gradients in fp32 (the sharded master weights keep the model's dtype); 'no': as is.

    Raises:
        RuntimeError: this torch's FSDP2 is not one this module supports (`unsupported_torch`).
    """
    if (problem := unsupported_torch()) is not None:
        raise RuntimeError(problem)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if not torch.distributed.is_initialized():  # one plain process: a group of one, as torchrun would
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=torch.distributed.HashStore(), world_size=1, rank=0
        )
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    policy = (
        MixedPrecisionPolicy(param_dtype=dtypes[mixed], reduce_dtype=torch.float32)
        if mixed in dtypes
        else MixedPrecisionPolicy()
    )
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=SHARDING[sharding], mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    # FSDP2 takes the first unit to run a forward as its root; PPO's first forward is a direct
    # call on the policy, so the root is fixed now (FSDPState._lazy_init, private: what the
    # root's first forward would run).
    fully_shard.state(model)._lazy_init()
    return model


def _units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Every unit inside `model` holds its whole weights for the body, and forwards inside it run
    without collectives (so ranks may run different numbers of them: sampling until EOS).
    Costs the whole module's weights on every rank for the body (as DDP holds them all along).
    Every rank must enter it (it all-gathers); a unit already whole is left to its owner.
    (FSDP2 has no summon_full_params: units are unsharded and kept so through forwards by
    turning reshard-after-forward off, then restored; the param-group fields are private.)"""
    units = [u for u in _units(model) if not all(g.is_unsharded for g in param_groups(u._get_fsdp_state()))]
    saved = [[g.post_forward_mesh_info for g in param_groups(u._get_fsdp_state())] for u in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit, infos in zip(units, saved):
            unit.reshard()
            for group, info in zip(param_groups(unit._get_fsdp_state()), infos):
                group.post_forward_mesh_info = info


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (all ranks call it in the same order); others as they are."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every shard gathered, on the CPU (every rank calls it; each gets
    the whole state: one tensor at a time on the device)."""
    return {k: full_tensor(v.detach()).cpu() for k, v in module.state_dict().items()}


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The given named tensors whole (gathered where sharded), detached copies."""
    return {n: full_tensor(p.detach()).clone() for n, p in named}


def load_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole `value` into `param`, into this rank's shard when it is one (no communication:
    every rank holds the whole value and cuts its own piece)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            value = distribute_tensor(
                value.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
            )
        param.copy_(value.to(param.device, param.dtype))


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The whole optimizer state keyed by parameter name (gathered; every rank calls it and gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # A forward without a backward (a held-out evaluation) leaves the root unit, which does not
    # reshard after its forward, holding whole weights that the optimizer's sharded parameters no
    # longer map onto: every unit goes back to its shards first.
    for unit in _units(model):
        unit.reshard()
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return _to_cpu(state)


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load what `optimizer_state` returned; every rank keeps its own shards of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def parameter_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The name of every parameter the optimizer steps, in its state_dict's index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def keyed_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter name (FSDP's), from torch's index keys (DDP's) or as it is.
    Both engines build the optimizer's groups alike, so index k is the k-th of `names`."""
    return _rekeyed(state, lambda key: names[key] if isinstance(key, int) else key)


def keyed_by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by index (torch's, DDP's), from parameter names (FSDP's) or as it is."""
    index = {n: i for i, n in enumerate(names)}
    return _rekeyed(state, lambda key: index[key] if isinstance(key, str) else key)


def _rekeyed(state: dict, key) -> dict:
    groups = [{**g, "params": [key(p) for p in g["params"]]} for g in state["param_groups"]]
    return {**state, "state": {key(k): v for k, v in state["state"].items()}, "param_groups": groups}


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
