"""The capability table as README.md shows it (`relay capabilities`, `--write-readme`): every cell of
pipeline/config/capabilities.py, each with the tests that run it or the one line that refuses it, and
the counts above it; written between the README's markers only."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Optional

from pipeline.config.capabilities import ENGINES, GRPO_OPTIONS, JUDGE_TESTS, TOOLS, cells, refusal

BEGIN, END = "<!-- capabilities:begin -->", "<!-- capabilities:end -->"


def counts() -> tuple[int, int, int]:
    """(cells run by the suite, cells refused, cells run by the suite on CUDA only)."""
    tested = refused = cuda_only = 0
    for cell in cells():
        if refusal(cell, cuda=True) is None:
            tested += 1
            cuda_only += refusal(cell, cuda=False) is not None
        else:
            refused += 1
    return tested, refused, cuda_only


def render() -> str:
    """The capability table as markdown: a row per stage (and, for policy stages, per backend, tools
    and correction) and adapter with at least one supported engine; columns the engines. Every other
    combination is refused, each reason listed once with how many cells it refuses."""
    reasons: dict[str, int] = {}
    rows: list[str] = []
    for key, group in itertools.groupby(cells(), key=lambda c: (c.stage, c.backend, c.tools, c.correction, c.adapter)):
        marks, any_supported = [], False
        for cell in group:
            line = refusal(cell, cuda=True)
            if line is None:
                any_supported = True
                marks.append("CUDA" if refusal(cell, cuda=False) else "yes")
                continue
            reason = "not run by the test suite yet" if line.startswith("combination ") else line
            reasons[reason] = reasons.get(reason, 0) + 1
            marks.append(f"no ({list(reasons).index(reason) + 1})")
        if any_supported:
            stage, backend, tools, correction, adapter = key
            rows.append(f"| {stage} | {backend} | {tools} | {correction} | {adapter} | " + " | ".join(marks) + " |")
    tested, refused, cuda_only = counts()
    head = [
        "| stage | backend | tools | correction | adapter | " + " | ".join(e.label for e in ENGINES.values()) + " |",
        "|" + "---|" * (5 + len(ENGINES)),
    ]
    notes = [f"{i}. {reason} ({n} cells)" for i, (reason, n) in enumerate(reasons.items(), 1)]
    options = [
        f"- `grpo.{option}`: {', '.join(names)}: each in every supported grpo row (golden tests against TRL and verl)."
        for option, names in GRPO_OPTIONS.items()
    ]
    options.append(
        "- `judge:` (an LLM judge reward, alone or beside the others) runs where the rest of its config runs "
        "(the table above) under these engines; under any other engine it is refused before any model loads:"
    )
    stages = dict.fromkeys(stage for stage, _, _ in JUDGE_TESTS)
    for stage, tools in itertools.product(stages, TOOLS):
        engines = [e.label for name, e in ENGINES.items() if (stage, tools, name) in JUDGE_TESTS]
        if engines:
            options.append(f"  - {stage}, tools {tools}: {', '.join(engines)}")
    return "\n".join(
        [
            f"{tested} combinations are trained by the "
            f"test suite ({cuda_only} of them on a CUDA GPU only); {refused} are "
            "refused before any model loads. yes: runs; "
            "CUDA: runs on a CUDA GPU; no (n): refused for reason n. Rows whose "
            "every engine is refused are left out. One "
            "process is `distributed.engine: "
            "ddp` without `--nproc`; DDP is more than one rank.",
            "",
            *head,
            *rows,
            "",
            "Refused:",
            "",
            *notes,
            "",
            *options,
        ]
    )


def write_readme(path: Path) -> bool:
    """Replace the text between the capability markers of `path` with `render()`; False when the
    markers are missing (nothing is written).

    Raises:
        OSError: the file cannot be read or written.
    """
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        return False
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    new = f"{before}{BEGIN}\n{render()}\n{END}{after}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return True


def readme_block(text: str) -> Optional[str]:
    """The text between the markers (None: no markers)."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
