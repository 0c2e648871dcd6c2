"""README.md and docs/*.md name only what exists.

Every command in a bash block is checked without running it: a `relay SUBCOMMAND` is one the CLI
has (`pipeline.tools.cli.COMMANDS`, read in-process without importing torch), and each option given
to it is one its command line parses; `bash X.sh`, `python -m MODULE`, `python FILE.py` and
`torchrun ... FILE.py` name files of this tree; every repository path (a config, a script, a data
file) that a block, an inline code span or a link names is there. A `relay ...` inline code span
in the prose is held to the same rule as a block. The README opens with the two commands that
`.ci/run` and a newcomer run, and stays short enough to read.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

import pytest

from pipeline.tools import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 25_000
FIRST_COMMANDS = ["bash run_scripts/demo.sh", "bash run_scripts/test.sh"]
SOURCE_DIRS = (
    "bench",
    "configs",
    "data",
    "data_formats",
    "deepspeed_configs",
    "docs",
    "pipeline",
    "run_scripts",
    "stages",
    "tests",
    ".ci",
)
"""A path whose first part is one of these is a file of this tree and must exist; anything else
(outputs/, release/, /models/..., a user's DIR) is the reader's own."""
TOP_FILES = ("README.md", "ARCHITECTURE.md", "pyproject.toml")
SHELL_WORDS = ("nice", "time", "env", "exec", "sudo")
SEPARATORS = ("|", "||", "&&", ";", "&")
# Where a subcommand's options are parsed, beyond its own module: the CLI itself (--nproc, --stage,
# --kind ...), and for `relay pipeline` the bash driver and the chain config it hands them to.
OPTION_SOURCES = {
    "pipeline": [
        "run_scripts/run_pipeline.sh",
        "pipeline/tools/chain.py",
        "pipeline/tools/chain_config.py",
        "pipeline/tools/driver.py",
    ]
}
CONFIG_SOURCES = ("pipeline", "stages")
"""Where the config dataclasses live: a dotted override's every part must be a field there."""


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, language, body) of every fenced block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w+-]*)", line)
        if fence and lang is None:
            lang, start, body = fence.group(1) or "text", number, []
        elif fence:
            blocks.append((start, lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def bash_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """A bash block's logical lines (backslash continuations joined), with their line numbers."""
    lines, pending, start = [], "", 0
    for offset, line in enumerate(body.splitlines(), 1):
        if not pending:
            start = first_line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    if pending:
        lines.append((start, pending))
    return [(n, line) for n, line in lines if line.strip() and not line.lstrip().startswith("#")]


def commands_of(line: str) -> list[list[str]]:
    """The simple commands of one shell line, each as its words (comments dropped).

    Raises:
        ValueError: the line does not split as shell words (an unclosed quote).
    """
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    out = []
    for words in commands:
        while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in SHELL_WORDS):
            words = words[1:]
        if words:
            out.append(words)
    return out


def expand_braces(word: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [
        w
        for part in match.group(1).split(",")
        for w in expand_braces(word[: match.start()] + part + word[match.end() :])
    ]


def repo_path_problem(word: str) -> str | None:
    """Why a word that names a file of this tree does not resolve, or None (also for other words)."""
    word = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
    word = word.rstrip(",.:;)")
    if word.startswith("./"):
        word = word[2:]
    first = word.split("/", 1)[0]
    if not (first in SOURCE_DIRS and "/" in word) and word not in TOP_FILES:
        return None
    if not re.fullmatch(r"[\w.*?{},/+-]+", word):
        return None
    for path in expand_braces(word):
        if any(c in path for c in "*?"):
            if not glob.glob(str(ROOT / path)):
                return f"{path}: matches no file"
        elif not (ROOT / path).exists():
            return f"{path}: no such file or folder"
    return None


def module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _source_text(paths) -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


_CONFIG_TEXT: list[str] = []


def config_fields_text() -> str:
    if not _CONFIG_TEXT:
        _CONFIG_TEXT.append(_source_text(p for d in CONFIG_SOURCES for p in (ROOT / d).rglob("*.py")))
    return _CONFIG_TEXT[0]


def is_config_key(name: str) -> bool:
    """A config section or field name of some stage or pipeline config dataclass (`name: type`)."""
    return re.search(rf"^\s+{re.escape(name)}\s*:", config_fields_text(), re.M) is not None


def relay_problems(words: list[str]) -> list[str]:
    """What is wrong with one `relay ...` command (a subcommand the CLI lacks, an option it never parses)."""
    if len(words) < 2 or words[1] in ("-h", "--help") or words[1].isupper():  # `relay COMMAND --help`: a placeholder
        return []
    sub = words[1]
    if sub not in cli.COMMANDS:
        return [f"`relay {sub}`: no such subcommand (relay has: {', '.join(cli.COMMANDS)})"]
    module = cli.COMMANDS[sub][0]
    sources = [ROOT / "pipeline/tools/cli.py"] + [ROOT / p for p in OPTION_SOURCES.get(sub, [])]
    if module:
        sources.append(module_file(module))
    text = _source_text(sources)
    problems = []
    for word in words[2:]:
        if not word.startswith("--") or word == "--":
            continue
        option = word.split("=", 1)[0]
        if "." in option:  # a dotted config override: every part is a section or a field
            bad = [part for part in option[2:].split(".") if not is_config_key(part)]
            if bad:
                problems.append(f"`relay {sub} {option}`: {'.'.join(bad)} is no config key")
        elif (
            f'"{option}"' not in text
            and f"'{option}'" not in text
            and not (sub in ("train", "validate", "pipeline") and is_config_key(option[2:]))
        ):
            problems.append(f"`relay {sub} {option}`: the subcommand has no such option")
    return problems


def command_problems(words: list[str]) -> list[str]:
    problems = [p for w in words if (p := repo_path_problem(w))]
    program = Path(words[0]).name
    if program == "relay":
        problems += relay_problems(words)
    elif program in ("bash", "sh") and len(words) > 1 and not words[1].startswith("-"):
        problems += [f"{script}: no such script" for script in expand_braces(words[1]) if not (ROOT / script).is_file()]
    elif re.fullmatch(r"python(3(\.\d+)?)?", program) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].split(".")[0] in SOURCE_DIRS:
            if module_file(words[2]) is None:
                problems.append(f"python -m {words[2]}: no such module in this tree")
        elif words[1].endswith(".py") and not (ROOT / words[1]).is_file():
            problems.append(f"{words[1]}: no such file")
    elif program == "torchrun":
        scripts = [w for w in words if w.endswith(".py")]
        problems += [f"{s}: no such stage script" for s in scripts if not (ROOT / s).is_file()]
    return problems


def doc_problems(path: Path) -> list[str]:
    """Every problem of one markdown file, as `FILE:LINE: reason`."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(ROOT)
    problems = []
    for start, lang, body in fenced_blocks(text):
        if lang not in ("bash", "sh", "shell"):
            continue
        for number, line in bash_lines(body, start):
            try:
                commands = commands_of(line)
            except ValueError as err:
                problems.append(f"{name}:{number}: not a shell line ({err})")
                continue
            problems += [f"{name}:{number}: {p}" for words in commands for p in command_problems(words)]
    prose = re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    for match in re.finditer(r"`([^`]+)`", prose):
        number = prose.count("\n", 0, match.start()) + 1
        span = " ".join(match.group(1).split())
        words = span.split()
        if words and Path(words[0]).name == "relay":
            try:
                for cmd in commands_of(span):
                    problems += [f"{name}:{number}: {p}" for p in command_problems(cmd)]
            except ValueError:
                problems += [f"{name}:{number}: {p}" for p in relay_problems(words)]
        elif len(words) == 1 and (p := repo_path_problem(words[0])):
            problems.append(f"{name}:{number}: {p}")
    for match in re.finditer(r"\]\(([^)\s]+)\)", prose):
        target = match.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            number = prose.count("\n", 0, match.start()) + 1
            problems.append(f"{name}:{number}: link to {target}: no such file")
    return problems


def test_the_docs_checked_are_there():
    assert README.is_file()
    assert len(DOCS) > 1, "docs/*.md: the reference pages are missing"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_path_exists(doc):
    problems = doc_problems(doc)
    assert not problems, "\n".join(problems)


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    blocks = fenced_blocks(README.read_text(encoding="utf-8"))
    assert blocks and blocks[0][1] == "bash", "README.md: the first block must be the bash block of the two commands"
    first = [" ".join(words) for _, line in bash_lines(blocks[0][2], blocks[0][0]) for words in commands_of(line)]
    assert first[:2] == FIRST_COMMANDS
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    assert [line for line in ci.splitlines() if line.startswith("bash ")] == [FIRST_COMMANDS[1]]


def test_readme_is_short():
    size = README.stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move reference detail into docs/"


def test_readme_has_the_capability_table_markers():
    text = README.read_text(encoding="utf-8")
    heading = text.find("\n## What runs with what\n")
    begin, end = text.find("<!-- capabilities:begin -->"), text.find("<!-- capabilities:end -->")
    assert heading >= 0, "README.md: no section '## What runs with what'"
    assert heading < begin < end, "README.md: the capability markers belong in '## What runs with what', in order"
    assert text.count("<!-- capabilities:begin -->") == text.count("<!-- capabilities:end -->") == 1
    after = text.find("\n## ", heading + 1)
    assert after == -1 or after > end, "README.md: the capability markers belong in '## What runs with what'"


def test_the_checker_catches_what_it_is_for():
    """Negative controls: each kind of mistake the docs could make is reported."""
    assert relay_problems(["relay", "gold", "--backend", "vllm"])
    assert relay_problems(["relay", "serve", "DIR", "--no-such-flag"])
    assert relay_problems(["relay", "train", "configs/sft.yaml", "--train.no_such_key", "1"])
    assert not relay_problems(["relay", "train", "configs/sft.yaml", "--train.max_steps", "5", "--nproc", "2"])
    assert not relay_problems(["relay", "serve", "DIR", "--backend", "vllm", "--eager"])
    assert command_problems(["bash", "run_scripts/no_such.sh"])
    assert command_problems(["relay", "train", "configs/no_such.yaml"])
    assert command_problems(["python", "-m", "pipeline.tools.no_such"])
    assert not command_problems(["python", "-m", "pipeline.tools.gold", "--help"])
    assert not command_problems(["relay", "validate", "--kind", "sft", "data/sample/sft/train/*.jsonl"])
    assert commands_of("A=1 bash run_scripts/test.sh -x && relay report outputs/x  # note") == [
        ["bash", "run_scripts/test.sh", "-x"],
        ["relay", "report", "outputs/x"],
    ]


def test_readme_stage_table_has_every_stage_and_names_its_own_sections():
    """The README's "Each stage" table had no distill row, and its list of the sections a stage adds
    left out distill's, `teacher`, `judge` and `reward_model`: each registered stage has a row, and
    every section a stage's config adds beyond the shared ones is named."""
    import dataclasses

    import stages as registry
    from pipeline.config.sections import StageConfig

    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Each stage") : text.index("\n## ", text.index("## Each stage") + 1)]
    scripts = set(re.findall(r"^\| [^|]+ \| `stages/(\w+)\.py` \|", section, re.M))
    assert scripts == {registry.script(s).stem for s in registry.STAGES}
    shared = {f.name for f in dataclasses.fields(StageConfig)} | {"data"}
    own = {f.name for s in registry.STAGES for f in dataclasses.fields(registry.config_class(s))} - shared
    adds = section[section.index("adds its own") : section.index("Each shipped YAML")]
    assert own <= set(re.findall(r"`(\w+)`", adds)), sorted(own - set(re.findall(r"`(\w+)`", adds)))


def test_readme_judge_note_names_each_stage_and_tools_once():
    """The capability notes' `judge:` bullet listed test runs ("ppo with tools on (FSDP2); grpo with
    tools on (ZeRO-2); ..."): it now gives one line per stage and tools setting with the engines."""
    from pipeline.config.capabilities import ENGINES, JUDGE_TESTS

    text = README.read_text(encoding="utf-8")
    lines = re.findall(r"^  - (\w+), tools (on|off): (.+)$", text[text.index("- `judge:`") :], re.M)
    named = [(stage, tools) for stage, tools, _ in lines]
    assert len(named) == len(set(named)) and set(named) == {(s, t) for s, t, _ in JUDGE_TESTS}
    for stage, tools, engines in lines:
        assert engines.split(", ") == [e.label for n, e in ENGINES.items() if (stage, tools, n) in JUDGE_TESTS]
