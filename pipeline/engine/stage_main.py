"""Every stage script's entry point (`main(StageClass)`): the config parsed, the stage run, its summary
printed; every early end one line on stderr with its exit code (pipeline/engine/stage.py's docstring)."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.config import ConfigError, load_config
from pipeline.engine.checkpoint import CheckpointError
from pipeline.engine.divergence import Diverged
from pipeline.engine.interrupt import EarlyEnd, Stopped
from pipeline.engine.launch import CONFIG_PROBLEMS
from pipeline.engine.stage import Stage
from pipeline.engine.steps import NonFiniteError
from pipeline.engine.tracking import (
    format_stage_summary,
    quiet_console,
)
from pipeline.modeling.vllm_server import VLLMError


def main(stage_class: type[Stage], argv: Optional[Sequence[str]] = None) -> int:
    """Every stage script's entry point: parse the config, run the stage, print its summary.
    Every early end is one line on stderr (module docstring): config problems (a list) exit 2, a
    signal 128 + its number, a divergence, a non-finite step, a checkpoint error or a vLLM server's
    failure (its log and cause named: pipeline/modeling/vllm_server.py) 1."""

    logging.basicConfig(
        level=os.environ.get("RELAY_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_console()
    prog = f"stages/{Path(inspect.getfile(stage_class)).name}"
    stage = None
    try:
        stage = stage_class(load_config(stage_class.config_class, argv, prog=prog))
        completed = stage.run()
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank finds the same problems: said once
            print(err, file=sys.stderr)
        return CONFIG_PROBLEMS
    except Stopped as err:
        if stage is None or stage.is_main:
            print(f"{stage_class.name}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(
            f"{stage_class.name}: stopped at once by a second Ctrl-C, without saving; rerun the same command to "
            f"continue from the last checkpoint",
            file=sys.stderr,
        )
        return 130
    except Diverged as err:  # the ranks agree on it (ranks_max): said once
        if stage is None or stage.is_main:
            print(f"{stage_class.name}: {err}", file=sys.stderr)
        return 1
    except (NonFiniteError, CheckpointError, VLLMError, EarlyEnd) as err:
        print(f"{stage_class.name}: {err}", file=sys.stderr)
        return 1
    if completed and stage.is_main:
        print(format_stage_summary(stage.name, stage.final_summary, stage.cfg.output_dir, stage.model_kind))
    return 0
