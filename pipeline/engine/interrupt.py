"""Stopping a run cleanly: SIGTERM (preemption, `kill`, torchrun's shutdown) and SIGINT (Ctrl-C).

A signal only sets a flag (`StopRequest`); the stage finishes the step it is in (its
generation, its evaluation), and at the step boundary every rank agrees on whether any rank was
signalled (`agreed_signal`, one all-reduce), saves one complete checkpoint and raises `Stopped`.
`main` prints its one line and exits 128 + the signal number (143 for SIGTERM, 130 for SIGINT),
the shell's convention, so a driver or a scheduler sees that the run was stopped, not finished.
A second Ctrl-C stops at once without saving (the previous checkpoint stays).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

log = logging.getLogger(__name__)

STOP_ENV = "RELAY_STOP_AFTER_STEP"
"""Set to a step number, a stage saves a checkpoint after that step and exits 0 without merging
(tests, and a user who wants a checkpoint to resume from); the pipeline driver then stops quietly."""

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped at a step boundary after a signal (or another stop condition) and saved;
    `exit_code` is what the process should exit with, `str()` the user's one line."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class EarlyEnd(RuntimeError):
    """A run ended by something outside it (a reward endpoint that stopped answering, ...): the
    stage's entry point prints `str()` as its one line and exits 1, the run resuming from its last
    checkpoint when rerun. Raised by the layers above the engine (subclass it)."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The flag the signal handlers set. `install` only in the main thread (elsewhere, e.g. a
    test runner's worker thread, Python cannot install handlers and the request stays off)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            self.uninstall()
            raise KeyboardInterrupt("second Ctrl-C: stopping without saving (the previous checkpoint is kept)")
        if self.signum is None:
            self.signum = signum
            hint = "; press Ctrl-C again to stop at once without saving" if signum == signal.SIGINT else ""
            log.warning(
                "%s received: finishing this step, then saving a checkpoint and stopping%s", signal_name(signum), hint
            )


def ranks_max(value: int, accelerator) -> int:
    """The largest of every rank's `value` (one all-reduce; itself on one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return value
    import torch
    import torch.distributed as dist

    flag = torch.tensor([value], dtype=torch.long, device=accelerator.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def agreed_signal(local: Optional[int], accelerator) -> Optional[int]:
    """The signal any rank received (the largest number when several did), the same on every
    rank; None when none did."""
    return ranks_max(local or 0, accelerator) or None


def all_ranks_ok(ok: bool, accelerator) -> bool:
    """True only when every rank's `ok` is True."""
    return ranks_max(0 if ok else 1, accelerator) == 0
