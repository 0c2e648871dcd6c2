"""Checkpoints as in Levanter: temporary ones by time, permanent ones by a step keep-policy.

Layout: `<output_dir>/checkpoints/step-0000020/`. A checkpoint is written into a hidden staging
folder; every file is fsynced; the `.complete` marker (which records each file's size and sha256,
and the run's identity: see pipeline.engine.identity) is written and fsynced last; the folder is
renamed into place and the parent directory fsynced. So after a power loss a `step-*` folder
either has a marker whose files check out or it is not resumed from:
- a folder without the marker (a torn save) is moved aside at start-up, with a warning;
- a marked checkpoint whose files do not match the marker or fail to load is reported by name,
  moved aside to `checkpoints.corrupt/`, and the previous complete one is used (`candidates`);
- a staging folder left by a crash is deleted at start-up, with a warning;
- a save that finds the disk full (checked before writing from the state's size, and on
  ENOSPC while writing) removes its staging folder and raises `CheckpointError` naming the
  folder and the space needed; the previous checkpoint is untouched, and the previous temporary
  one is deleted only after the new one is complete and checks out.

A checkpoint's `state` is a dict of named parts:
- a dict of tensors (trainable weights)       -> `<name>.safetensors`
- 'optimizer' / 'scheduler' state dicts        -> `<name>.pt` (read back with weights_only=True)
- 'rng'                                        -> `rng-rank<r>.json`, one per rank (each rank has its own streams)
- any other JSON-able dict ('trainer', 'data') -> `<name>.json`

Resume policy (`checkpoint.resume`): true resumes from the newest complete checkpoint under
root; a path resumes from exactly that checkpoint; false starts fresh, and because a previous
run's completed checkpoints are never deleted silently, they are moved aside to
`checkpoints.old-<time>/` (logged) so the new run's temporary-checkpoint clean-up cannot touch them;
the stage moves that run's TensorBoard events to `runs.old-<time>/` (pipeline.engine.resume).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import CheckpointConfig, KeepPolicy, parse_duration
from pipeline.modeling.manifest import file_sha256

log = logging.getLogger(__name__)

MARKER = ".complete"
PREFIX = "step-"
STAGING = ".staging-"
TORCH_PARTS = ("optimizer", "scheduler")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message is one line for the user."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint (even with its marker) whose files do not check out or fail to load."""


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
                found.append((int(path.name[len(PREFIX) :]), path))
            except ValueError:
                continue
    return [path for _, path in sorted(found)]


def read_marker(path: Path) -> Optional[dict]:
    """The marker of a complete checkpoint, or None (no marker, or one that is not JSON)."""
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_bytes(value: Any) -> int:
    """About how many bytes `value` (tensors in nested dicts/lists, numbers, strings) takes on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values()) + 64 * len(value)
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value) + 8 * len(value)
    return 32


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is the disk being full. torch.save reports a short write
    as a RuntimeError ("unexpected pos ...") and safetensors as its own error ("os error 28"), so
    those count too."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in ("unexpected pos", "No space left", "os error 28")):
            return True  # torch's zip writer and safetensors' Rust writer wrap the OS error in their own
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def megabytes(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


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
    """Decides when to save, saves durably, finds and loads the checkpoint to resume from.

    `rank`/`world_size`/`barrier`/`agree` make it work under several processes: every rank calls
    `save` with the same step; rank 0 writes the shared parts, each rank its own RNG file;
    `agree(ok)` is True only when every rank passes True (so a rank that fails to write or read
    fails the others with it, instead of leaving them waiting at a barrier).
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
        agree: Callable[[bool], bool] = lambda ok: ok,
    ):
        self.root = Path(root)
        self.cfg = cfg
        self.clock = clock
        self.interval = parse_duration(cfg.save_interval)
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.agree = agree
        self.last_save_time = clock()
        self.aside: Optional[Path] = None
        """Where `candidates` moved the previous run's checkpoints (resume false), else None."""
        self.temporary: Optional[Path] = None

    def due(self, step: int) -> Optional[str]:
        """'permanent' (keep policy), 'temporary' (save_interval elapsed since the last save) or None."""
        if keep_checkpoint(step, self.cfg.keep):
            return "permanent"
        if self.clock() - self.last_save_time >= self.interval:
            return "temporary"
        return None

    def save(self, step: int, state: dict, *, lifetime: str, identity: Optional[dict] = None) -> Path:
        """Write `state` as the checkpoint of `step`; return its folder. `identity` (the run's
        identity, pipeline.engine.identity) is recorded in the marker.

        Raises:
            ValueError: unknown lifetime, or a part that is neither tensors nor JSON-able.
            CheckpointError: the disk is full or a write failed (on any rank); nothing of this
                save is left behind and the previous checkpoints are untouched.
        """
        if lifetime not in ("permanent", "temporary"):
            raise ValueError(f"checkpoint lifetime must be 'permanent' or 'temporary', got {lifetime!r}")
        final = self.root / step_dir_name(step)
        staging = self.root / f"{STAGING}{step_dir_name(step)}"
        needed = state_bytes(state) if self.rank == 0 else 0
        self.barrier()
        error: Optional[BaseException] = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                free = shutil.disk_usage(self.root).free
                if free < needed:
                    raise OSError(errno.ENOSPC, f"{megabytes(needed)} needed, {megabytes(free)} free")
                if staging.exists():
                    shutil.rmtree(staging)
                staging.mkdir(parents=True)
        except OSError as err:
            error = err
        self._check_all(error, step, staging, needed)
        try:
            if "rng" in state:
                self._write_file(staging / f"rng-rank{self.rank}.json", json.dumps(state["rng"]).encode())
            if self.rank == 0:
                self._write_parts(staging, {k: v for k, v in state.items() if k != "rng"})
        except ValueError:
            raise  # a part that cannot be serialised is a bug, not a disk problem
        except Exception as err:  # every writer's failure (OS, torch's zip writer, safetensors) ends the same way
            error = err
        self._check_all(error, step, staging, needed)
        try:
            if self.rank == 0:
                files = {
                    f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)} for f in sorted(staging.iterdir())
                }
                marker = {"step": step, "lifetime": lifetime, "world_size": self.world_size, "files": files}
                if identity is not None:
                    marker["identity"] = identity
                self._write_file(staging / MARKER, json.dumps(marker).encode())
                fsync_path(staging)
                if final.exists():
                    shutil.rmtree(final)
                staging.rename(final)
                fsync_path(self.root)
        except OSError as err:
            error = err
        self._check_all(error, step, staging, needed)
        if self.rank == 0:
            previous = self.temporary
            if previous is not None and previous != final and previous.exists():
                problem = self.verify(final)
                if problem is None:
                    shutil.rmtree(previous)
                else:
                    log.warning("%s; keeping the previous checkpoint %s", problem, previous)
        self.temporary = final if lifetime == "temporary" else None
        self.last_save_time = self.clock()
        self.barrier()
        return final

    def _check_all(self, error: Optional[BaseException], step: int, staging: Path, needed: int) -> None:
        """Stop every rank when any rank failed: remove the staging folder, raise one line."""
        if self.agree(error is None):
            return
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier()
        newest = complete_checkpoints(self.root)
        kept = f"the previous checkpoint {newest[-1]} is intact" if newest else "there is no earlier checkpoint"
        if error is None:
            raise CheckpointError(f"saving checkpoint step {step} in {self.root} failed on another rank; {kept}")
        if is_disk_full(error):
            free = shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
            raise CheckpointError(
                f"no space left on device: checkpoint step {step} needs about {megabytes(needed)} in "
                f"{self.root}, {megabytes(free)} free; {kept}; free space and rerun the same command"
            ) from error
        raise CheckpointError(f"saving checkpoint step {step} in {self.root} failed: {error}; {kept}") from error

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        """Write and fsync one file."""
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def _write_parts(cls, folder: Path, parts: dict) -> None:
        for name, value in parts.items():
            if name in TORCH_PARTS:
                path = folder / f"{name}.pt"
                torch.save(value, path)
            elif _is_tensor_dict(value):
                path = folder / f"{name}.safetensors"
                save_file({k: v.detach().contiguous().cpu() for k, v in value.items()}, str(path))
            else:
                try:
                    text = json.dumps(value)
                except TypeError as err:
                    raise ValueError(f"checkpoint part {name!r} is neither tensors nor JSON-able: {err}") from err
                cls._write_file(folder / f"{name}.json", text.encode())
                continue
            fsync_path(path)

    def clean_start(self) -> None:
        """Rank 0, before looking for a checkpoint: delete staging folders a crash left behind and
        move aside `step-*` folders without a marker (torn saves), each with a warning."""
        if self.rank != 0 or not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            if path.is_dir() and path.name.startswith(STAGING):
                shutil.rmtree(path, ignore_errors=True)
                log.warning("deleted %s, the staging folder of a save that did not finish", path)
            elif path.is_dir() and path.name.startswith(PREFIX) and not (path / MARKER).is_file():
                self.move_aside(path, f"{path} has no {MARKER} marker (a save that did not finish)")

    def move_aside(self, path: Path, reason: str) -> Optional[Path]:
        """Rank 0 moves a checkpoint that must not be resumed to `<root>.corrupt/`, with a warning."""
        if self.rank != 0:
            return None
        aside = self.root.with_name(f"{self.root.name}.corrupt") / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        Path(path).rename(aside)
        log.warning("%s; moved it aside to %s", reason, aside)
        return aside

    def candidates(self) -> list[Path]:
        """The checkpoints to try under `cfg.resume`, newest first (resume falls back along
        them); empty to start fresh. Cleans the folder first (`clean_start`).

        With resume false, existing complete checkpoints are moved aside (rank 0), never deleted.

        Raises:
            FileNotFoundError: an explicit path that is not a complete checkpoint.
        """
        resume = resume_setting(self.cfg)
        if resume is True:
            self.clean_start()
            self.barrier()
            return list(reversed(complete_checkpoints(self.root)))
        if resume is False:
            if self.rank == 0 and complete_checkpoints(self.root):
                aside = self.root.with_name(f"{self.root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
                self.root.rename(aside)
                self.aside = aside
                log.warning("checkpoint.resume is false: moved the previous run's checkpoints to %s", aside)
            self.barrier()
            return []
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no {MARKER} marker)")
        return [path]

    def resume_path(self) -> Optional[Path]:
        """The newest checkpoint `candidates` offers, or None to start fresh."""
        found = self.candidates()
        return found[0] if found else None

    def verify(self, path: Path) -> Optional[str]:
        """Why the checkpoint at `path` does not match its marker (a missing file, another size
        or sha256), or None when it does. A marker from before sizes were recorded checks nothing."""
        marker = read_marker(path)
        if marker is None:
            return f"{path}: its {MARKER} marker is unreadable"
        for name, record in marker.get("files", {}).items():
            file = Path(path) / name
            if not file.is_file():
                return f"{path}: {name} is missing"
            size = file.stat().st_size
            if size != record["bytes"]:
                return f"{path}: {name} has {size} bytes, the marker recorded {record['bytes']} (a torn write)"
            if file_sha256(file) != record["sha256"]:
                return f"{path}: {name} does not match the sha256 its marker recorded (damaged on disk)"
        return None

    def load(self, path: Path) -> dict:
        """Every part of the checkpoint at `path`; 'rng' is this rank's RNG state (absent when the
        checkpoint was written by fewer ranks, logged); 'marker' its marker.

        Raises:
            FileNotFoundError: `path` is not a complete checkpoint.
            CorruptCheckpoint: a file does not match the marker or cannot be read.
        """
        path = Path(path)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
        problem = self.verify(path)
        if problem is not None:
            raise CorruptCheckpoint(problem)
        out: dict = {}
        for file in sorted(path.iterdir()):
            name = file.name
            try:
                if name.endswith(".safetensors"):
                    out[name[: -len(".safetensors")]] = load_file(str(file))
                elif name.endswith(".pt"):
                    out[name[:-3]] = torch.load(file, map_location="cpu", weights_only=True)
                elif name.endswith(".json") and not name.startswith("rng-rank"):
                    out[name[:-5]] = json.loads(file.read_text())
            except Exception as err:  # any reader's failure means the same: this file is damaged
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CorruptCheckpoint(f"{path}: {name} cannot be read ({first})") from err
        rng = path / f"rng-rank{self.rank}.json"
        if rng.is_file():
            out["rng"] = json.loads(rng.read_text())
        else:
            log.warning("%s has no RNG state for rank %d: RNG streams start from the seed", path, self.rank)
        out["marker"] = read_marker(path)
        if out["marker"].get("lifetime") == "temporary" and path.parent.resolve() == self.root.resolve():
            # Resumed from a temporary checkpoint: it is the one to delete when the next one lands.
            self.temporary = path
        return out


def resume_setting(cfg: CheckpointConfig):
    """`cfg.resume` as True, False or a path string."""
    resume = cfg.resume
    if isinstance(resume, str) and resume.lower() in ("true", "false"):
        return resume.lower() == "true"
    return resume


def newest_identity(root: Path, cfg: CheckpointConfig) -> Optional[tuple[Path, Optional[dict]]]:
    """The checkpoint a run would resume from and the identity its marker records (None: a
    marker from before identities), without touching the folder; None when it would start
    fresh. Markers that are not JSON are passed over (resume moves those aside)."""
    resume = resume_setting(cfg)
    if resume is False:
        return None
    paths = [Path(resume)] if resume is not True else list(reversed(complete_checkpoints(root)))
    for path in paths:
        marker = read_marker(path)
        if marker is not None:
            return path, marker.get("identity")
    return None
