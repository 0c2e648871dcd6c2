"""torchrun without the tracebacks: `python -m pipeline.engine.launch [torchrun options] SCRIPT [ARGS]`.

It runs torch's own launcher (`torch.distributed.run`, same options, same rendezvous) and only
changes how a run that ends early reads. torchrun reports any worker that exits non-zero with a
`ChildFailedError` traceback, also when the workers stopped on purpose (a signal: each printed
its one line and saved a checkpoint); and a SIGTERM to torchrun itself (a preempted job) ends in
a `SignalException` traceback after it forwarded the signal to the workers. Here both end with
one line and the workers' exit code (143 for SIGTERM, 130 for SIGINT, as a single process
exits), so a driver or a scheduler reads the same code with one process or many. Without
`--log-dir`, torchrun's folder for the workers' logs (a `torchelastic_*` folder in TMPDIR, left
behind at every launch) is removed after the run when it holds no file.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Optional, Sequence

CONFIG_PROBLEMS = 2
"""A stage's exit code when its config or data has problems (listed before it exits; stage_main)."""


def describe(exit_code: int) -> str:
    """'exit code 1', or 'stopped by SIGTERM' for 128 + a signal number / a negative code."""
    number = exit_code - 128 if exit_code > 128 else -exit_code if exit_code < 0 else 0
    try:
        return f"stopped by {signal.Signals(number).name}" if number else f"exit code {exit_code}"
    except ValueError:
        return f"exit code {exit_code}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.run import parse_args

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    own_logs = not args.log_dir  # torchrun would make this folder itself and leave it
    if own_logs:
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        return _run(args)
    finally:
        if own_logs:
            remove_if_no_file(args.log_dir)


def remove_if_no_file(folder: str) -> None:
    """Remove `folder` when nothing under it is a file (torchrun's empty per-rank folders)."""
    if not any(files for _, _, files in os.walk(folder)):
        shutil.rmtree(folder, ignore_errors=True)


def _run(args) -> int:
    """torchrun's `run(args)`, its early ends as one line and the workers' exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # torchrun's own ERROR line for a failed worker ("failed (exitcode: 2) local_rank: 0 ...") says
    # again, less plainly, what the line below says
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(
            f"launch: rank {rank} ended first ({describe(failure.exitcode)}); every rank has stopped; "
            f"its own message is above",
            file=sys.stderr,
        )
        return code
    except SignalException as err:
        print(
            f"launch: stopped by {err.sigval.name}; the workers were asked to save and stop (their lines are above)",
            file=sys.stderr,
        )
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
