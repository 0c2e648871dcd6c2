"""Checkpoints as in Levanter: temporary ones by time, permanent ones by a step keep-policy.

Layout: `<output_dir>/checkpoints/step-0000020/`. A checkpoint is written into a hidden staging
folder, gets its `.complete` marker last, and is then renamed into place, so a folder named
`step-*` without the marker (a crash, a full disk) is never resumed from.

A checkpoint's `state` is a dict of named parts:
- a dict of tensors (trainable weights)       -> `<name>.safetensors`
- 'optimizer' / 'scheduler' state dicts        -> `<name>.pt` (read back with weights_only=True)
- 'rng'                                        -> `rng-rank<r>.json`, one per rank (each rank has its own streams)
- any other JSON-able dict ('trainer', 'data') -> `<name>.json`

Resume policy (`checkpoint.resume`): true resumes from the newest complete checkpoint under
root; a path resumes from exactly that checkpoint; false starts fresh, and because a previous
run's completed checkpoints are never deleted silently, they are moved aside to
`checkpoints.old-<time>/` (logged) so the new run's temporary-checkpoint clean-up cannot touch them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import CheckpointConfig, KeepPolicy, parse_duration

log = logging.getLogger(__name__)

MARKER = ".complete"
PREFIX = "step-"
TORCH_PARTS = ("optimizer", "scheduler")


def keep_checkpoint(step: int, keep: list[KeepPolicy]) -> bool:
    """Whether `step` gets a permanent checkpoint under Levanter's keep policy.

    Rules apply in order: each covers the steps after the previous rule's `until` up to its own
    `until` (None: the rest of the run), keeping steps that are multiples of its `every`.
    Step 0 is never kept (nothing has been trained yet).
    """
    if step <= 0:
        return False
    for rule in keep:
        if rule.until is None or step <= rule.until:
            return rule.every > 0 and step % rule.every == 0
    return False


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first (folders without the marker are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith(PREFIX) and (path / MARKER).is_file():
            try:
                found.append((int(path.name[len(PREFIX):]), path))
            except ValueError:
                continue
    return [path for _, path in sorted(found)]


def rng_state() -> dict:
    """Python, numpy and torch (CPU + every CUDA device) RNG states as JSON-able data."""
    np_state = np.random.get_state()
    state = {
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


@contextlib.contextmanager
def seeded_fork(seed: int):
    """Run the body on RNG streams seeded with `seed`, then give every stream back its state.

    `torch.manual_seed` seeds the CPU generator and every CUDA device's, so every one of them is
    forked (`fork_rng(devices=[])` forks only the CPU's, and a seeded evaluation would reset
    training's CUDA sampling stream).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned.

    Raises:
        KeyError: a stream is missing from `state`.
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _is_tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


class Checkpointer:
    """Decides when to save, saves atomically, finds and loads the checkpoint to resume from.

    `rank`/`world_size`/`barrier` make it work under several processes: every rank calls
    `save` with the same step; rank 0 writes the shared parts, each rank its own RNG file.
    """

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] = lambda: None,
    ):
        self.root = Path(root)
        self.cfg = cfg
        self.clock = clock
        self.interval = parse_duration(cfg.save_interval)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.last_save_time = clock()
        self.temporary: Optional[Path] = None

    def due(self, step: int) -> Optional[str]:
        """'permanent' (keep policy), 'temporary' (save_interval elapsed since the last save) or None."""
        if keep_checkpoint(step, self.cfg.keep):
            return "permanent"
        if self.clock() - self.last_save_time >= self.interval:
            return "temporary"
        return None

    def save(self, step: int, state: dict, *, lifetime: str) -> Path:
        """Write `state` as the checkpoint of `step`; return its folder.

        Written into a staging folder, marked complete, then renamed; the previous temporary
        checkpoint is deleted only after the new one is complete.

        Raises:
            ValueError: unknown lifetime, or a part that is neither tensors nor JSON-able.
        """
        if lifetime not in ("permanent", "temporary"):
            raise ValueError(f"checkpoint lifetime must be 'permanent' or 'temporary', got {lifetime!r}")
        final = self.root / step_dir_name(step)
        staging = self.root / f".staging-{step_dir_name(step)}"
        self.barrier()
        if self.rank == 0:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        self.barrier()
        if "rng" in state:
            (staging / f"rng-rank{self.rank}.json").write_text(json.dumps(state["rng"]))
        if self.rank == 0:
            self._write_parts(staging, {k: v for k, v in state.items() if k != "rng"})
        self.barrier()
        if self.rank == 0:
            (staging / MARKER).write_text(json.dumps({"step": step, "lifetime": lifetime, "world_size": self.world_size}))
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
            previous = self.temporary
            if previous is not None and previous != final and previous.exists():
                shutil.rmtree(previous)
        self.temporary = final if lifetime == "temporary" else None
        self.last_save_time = self.clock()
        self.barrier()
        return final

    @staticmethod
    def _write_parts(folder: Path, parts: dict) -> None:
        for name, value in parts.items():
            if name in TORCH_PARTS:
                torch.save(value, folder / f"{name}.pt")
            elif _is_tensor_dict(value):
                save_file({k: v.detach().contiguous().cpu() for k, v in value.items()}, str(folder / f"{name}.safetensors"))
            else:
                try:
                    text = json.dumps(value)
                except TypeError as err:
                    raise ValueError(f"checkpoint part {name!r} is neither tensors nor JSON-able: {err}") from err
                (folder / f"{name}.json").write_text(text)

    def resume_path(self) -> Optional[Path]:
        """The checkpoint to resume from under `cfg.resume`, or None to start fresh.

        With resume false, existing complete checkpoints are moved aside (rank 0), never deleted.

        Raises:
            FileNotFoundError: an explicit path that is not a complete checkpoint.
        """
        resume = self.cfg.resume
        if isinstance(resume, str) and resume.lower() in ("true", "false"):
            resume = resume.lower() == "true"
        if resume is True:
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        if resume is False:
            if self.rank == 0 and complete_checkpoints(self.root):
                aside = self.root.with_name(f"{self.root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
                self.root.rename(aside)
                log.warning("checkpoint.resume is false: moved the previous run's checkpoints to %s", aside)
            self.barrier()
            return None
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no {MARKER} marker)")
        return path

    def load(self, path: Path) -> dict:
        """Every part of the checkpoint at `path`; 'rng' is this rank's RNG state (absent when the
        checkpoint was written by fewer ranks, logged).

        Raises:
            FileNotFoundError: `path` is not a complete checkpoint.
        """
        path = Path(path)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
        out: dict = {}
        for file in sorted(path.iterdir()):
            name = file.name
            if name.endswith(".safetensors"):
                out[name[: -len(".safetensors")]] = load_file(str(file))
            elif name.endswith(".pt"):
                out[name[:-3]] = torch.load(file, map_location="cpu", weights_only=True)
            elif name.endswith(".json") and not name.startswith("rng-rank"):
                out[name[:-5]] = json.loads(file.read_text())
        rng = path / f"rng-rank{self.rank}.json"
        if rng.is_file():
            out["rng"] = json.loads(rng.read_text())
        else:
            log.warning("%s has no RNG state for rank %d: RNG streams start from the seed", path, self.rank)
        out["marker"] = json.loads((path / MARKER).read_text())
        if out["marker"].get("lifetime") == "temporary" and path.parent.resolve() == self.root.resolve():
            # Resumed from a temporary checkpoint: it is the one to delete when the next one lands.
            self.temporary = path
        return out


def trainable_state(model: torch.nn.Module, accelerator) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (full tensors, gathered under FSDP / ZeRO-3)."""
    names = {n for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
    if accelerator.num_processes > 1 and accelerator.distributed_type.name in ("FSDP", "DEEPSPEED"):
        full = accelerator.get_state_dict(model)
        return {k: v for k, v in full.items() if k in names}
    return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters() if n in names}


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], accelerator) -> None:
    """Copy checkpointed trainable weights into the model.

    Raises:
        KeyError: the checkpoint lacks a trainable parameter of the model, or has an unknown one.
    """
    params = dict(accelerator.unwrap_model(model).named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in tensors]
    unknown = [n for n in tensors if n not in params]
    if missing or unknown:
        raise KeyError(f"checkpoint does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
