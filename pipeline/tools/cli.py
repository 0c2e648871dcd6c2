"""The `relay` console script: one entry point dispatching to the modules.

    relay embedded                      # convert/locate the embedded SmolLM2-135M-Instruct folder
    relay merge ...                     # merge a LoRA adapter into its base (pipeline.modeling.merge)
    relay validate --kind sft FILES     # check data files, FILE:LINE: reason (data_formats.validate)
    relay report RUN_DIR                # report.md + plots from TensorBoard events
    relay chat --model DIR [--prompt TEXT] [--compare DIR2]
    relay pipeline [CONFIG] [--from S | --only S] [--key value]   # run_scripts/run_pipeline.sh

Every subcommand's own `--help` lists its options; the arguments after the subcommand are passed
through untouched, so `relay chat ...` and `python -m pipeline.tools.chat ...` are the same command.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

# Modules are imported only when their subcommand runs: `relay report` should not pay for torch.
COMMANDS = {
    "embedded": ("pipeline.modeling.embedded", "locate (converting once) the embedded model folder"),
    "merge": ("pipeline.modeling.merge", "merge a LoRA adapter into its base model"),
    "validate": ("data_formats.validate", "check data files record by record"),
    "report": ("pipeline.tools.report", "write report.md and plots for a run"),
    "chat": ("pipeline.tools.chat", "chat with a merged model"),
    "pipeline": (None, "run PT -> SFT -> RM -> PPO (run_scripts/run_pipeline.sh)"),
}
REPO = Path(__file__).resolve().parents[1]


def usage() -> str:
    lines = ["usage: relay COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines + ["", "relay COMMAND --help shows a command's options."])


def run_pipeline(args: Sequence[str]) -> int:
    """Run the bash driver (it lives in the source tree: Relay is installed editable)."""
    script = REPO / "run_scripts" / "run_pipeline.sh"
    if not script.is_file():
        print(f"error: {script} not found; `relay pipeline` needs the Relay source tree", file=sys.stderr)
        return 2
    return subprocess.call(["bash", str(script), *args])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[command][0]
    if module_name is None:
        return run_pipeline(rest)
    result = importlib.import_module(module_name).main(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
