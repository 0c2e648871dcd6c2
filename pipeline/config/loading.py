"""Loading a stage config: YAML (with ``!include``) + dotted CLI overrides -> unknown-key and type
checks (every problem at once) -> draccus decode. A text key takes its value as written, on the
command line and in the YAML; every other key reads its value as YAML."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar, Union

import draccus
import yaml
from draccus.parsers.yaml_loader import SafeLoaderWithInclusion

from pipeline.config.help import HABITS, config_help, habit_hint
from pipeline.config.sections import ConfigError

T = TypeVar("T")

NULL_TEXT = ("null", "Null", "NULL", "~")
"""YAML's words for null: given on the command line to an optional text key, they leave it unset."""


# --------------------------------------------------------------------------------------------
# Loading: YAML (+ !include) + CLI overrides -> unknown-key and type checks -> draccus decode
# --------------------------------------------------------------------------------------------


def _dataclass_of(tp: Any) -> Optional[type]:
    """The dataclass inside a type hint (Optional[X] -> X), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _list_item_dataclass(tp: Any) -> Optional[type]:
    if typing.get_origin(tp) in (list, Sequence, typing.Sequence):
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


class LocatedMap(dict):
    """A YAML mapping that knows where each of its keys was written: `where[key]` is
    `FILE:LINE` (the included file's own name for a key that came from an `!include`), and
    `text[key]` the text written for a key whose value is a scalar (`0123`, which YAML reads as 83)."""

    where: dict
    text: dict


def _at(data: Any, key: Any, origin: Optional[str]) -> str:
    """`FILE:LINE: ` for `key` of `data` when the loader recorded it, else `origin: ` (or nothing)."""
    place = getattr(data, "where", {}).get(key) or origin
    return f"{place}: " if place else ""


def _habit(names: Sequence[str], key: str) -> Optional[str]:
    """`habit_hint(key)` (another tool's name for a Relay key) where its Relay key is one of this
    config's (`names`: the top-level keys; a pipeline config has no train.* to point at), else None."""
    habit = HABITS.get(str(key).replace("-", "_"))
    top = habit.key.split(".")[0] if habit is not None else None
    return habit_hint(str(key)) if top in names or top == "config" else None


def unknown_keys(cls: type, data: Any, prefix: str = "", origin: Optional[str] = None) -> list[str]:
    """Every key in `data` that `cls` does not have, with its path and a suggestion; each starts
    with the file and line it was written at where `data` came from `read_yaml` (else `origin`).

    Walks nested dataclasses and lists of dataclasses; free-form dict fields are not checked.
    """
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            habit = _habit(names, key) if not prefix else None  # a YAML key of another tool's config
            hint = (
                f"; {habit.replace(chr(39) + '--', chr(39))}"
                if habit
                else f"; did you mean '{prefix}{close[0]}'?"
                if close
                else f"; known keys: {', '.join(names)}"
            )
            out.append(f"{_at(data, key, origin)}{path}: unknown key{hint}")
            continue
        sub = _dataclass_of(hints[key])
        if sub is not None:
            out.extend(unknown_keys(sub, value, f"{path}.", origin))
        item = _list_item_dataclass(hints[key])
        if item is not None and isinstance(value, list):
            for i, entry in enumerate(value):
                out.extend(unknown_keys(item, entry, f"{path}[{i}].", origin))
    return out


def type_name(tp: Any) -> str:
    """A type hint as a user reads it: int, float, a list of str, a mapping of keys, ... or null."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if typing.get_origin(tp) in (list, Sequence, typing.Sequence, tuple):
        return f"a list of {type_name(args[0])}" if args else "a list"
    if typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp):
        return "a mapping of keys"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in args)
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _decodes(tp: Any, value: Any) -> bool:
    try:
        draccus.decode(tp, value)
        return True
    except Exception:  # draccus raises several types for values it cannot decode
        return False


def takes_text(tp: Any) -> bool:
    """Whether `tp` holds text and nothing else but null (str, Optional[str]): its value is the text
    as written, never YAML's reading of it (a mapping for `Note: be brief`, 83 for `0123`, true for `yes`)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is Union else [tp]
    return bool(args) and all(a is str for a in args)


def _fits(tp: Any, value: Any) -> bool:
    """Whether a key of type `tp` takes `value` (as YAML reads it): as draccus decodes it, except that
    text is never made of a mapping or a list (draccus takes their Python repr as the text)."""
    args, origin = typing.get_args(tp), typing.get_origin(tp)
    if tp is type(None):
        return value is None
    if tp is str:
        return not isinstance(value, (dict, list))
    if origin is Union:
        return any(_fits(a, value) for a in args)
    if origin in (list, Sequence, typing.Sequence) and args and isinstance(value, list):
        return all(_fits(args[0], v) for v in value)
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return all(_fits(args[0], k) and _fits(args[1], v) for k, v in value.items())
    return _decodes(tp, value)


def _wrong_type(key: str, tp: Any, value: Any, shown: Any) -> str:
    """`key: expected T, got V` for `value` (shown as `shown`: the text typed on the command line)."""
    if takes_text(tp) and isinstance(value, (dict, list)):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        return f"{key}: expected a string, got {kind} ({shown!r}); quote the text to keep it as written"
    return f"{key}: expected {type_name(tp)}, got {shown!r}"


def wrong_types(cls: type, data: Any, prefix: str = "", origin: Optional[str] = None) -> list[str]:
    """Every value in `data` (a config mapping for `cls`) that its field's type cannot take, as
    `key: expected T, got V`: all of them (draccus's own decode stops at the first, in words of its
    own), placed as `unknown_keys` places them. Walks nested sections and lists of sections as
    `unknown_keys` does; unknown keys are its."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    out: list[str] = []
    for key, value in data.items():
        if key not in names:
            continue
        path, tp = f"{prefix}{key}", hints[key]
        sub, item = _dataclass_of(tp), _list_item_dataclass(tp)
        if sub is not None and isinstance(value, dict):
            out.extend(wrong_types(sub, value, f"{path}.", origin))
        elif item is not None and isinstance(value, list):
            for i, entry in enumerate(value):
                out.extend(wrong_types(item, entry, f"{path}[{i}].", origin) if isinstance(entry, dict) else [])
        elif not _fits(tp, value):
            out.append(_at(data, key, origin) + _wrong_type(path, tp, value, value))
    return out


def as_written(cls: type, data: Any) -> Any:
    """`data` (a config mapping for `cls` from `read_yaml(located=True)`) as plain data in which each
    text key (`takes_text`) holds the text written for it where YAML read a bool or a number
    (`run_name: 0123` is '0123', not '83'; `system_prompt: yes` is 'yes', not 'True')."""
    if not isinstance(data, dict):
        return plain(data)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    written = getattr(data, "text", {})
    out = {}
    for key, value in data.items():
        tp = hints[key] if key in names else None
        sub, item = (_dataclass_of(tp), _list_item_dataclass(tp)) if tp is not None else (None, None)
        if tp is not None and takes_text(tp) and isinstance(value, (bool, int, float)) and key in written:
            out[key] = written[key]
        elif sub is not None and isinstance(value, dict):
            out[key] = as_written(sub, value)
        elif item is not None and isinstance(value, list):
            out[key] = [as_written(item, entry) for entry in value]
        else:
            out[key] = plain(value)
    return out


def _override_type(cls: type, dotted: str) -> Optional[Any]:
    """The type of the field `--dotted` sets (None: inside a free-form field, or not a field)."""
    current: Any = cls
    for part in dotted.split("."):
        sub = _dataclass_of(current)
        if sub is None or part not in {f.name for f in dataclasses.fields(sub)}:
            return None
        current = typing.get_type_hints(sub)[part]
    return current


def read_overrides(cls: type, rest: Sequence[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """The command line's `--key value` (or `--key=value`) pairs, each value as its key takes it, and
    every problem: a value its key's type cannot take, a `--key` without a value, a word that is no
    option. A text key (`takes_text`) takes the value as typed (`null` leaves an optional one unset);
    any other key reads it as YAML (`[a, b]`: a list), or as the plain text where its type takes
    that and not YAML's reading. Unknown keys and sections are `_unknown_override`'s to report."""
    pairs: list[tuple[str, Any]] = []
    out: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        i += 1
        if not arg.startswith("--"):
            out.append(f"{arg!r}: not an option; options are --section.key VALUE")
            continue
        key, eq, value = arg[2:].partition("=")
        known = _unknown_override(cls, key) is None
        if not eq:
            if i >= len(rest) or rest[i].startswith("--"):
                out.extend([f"--{key}: needs a value"] if known else [])
                continue
            value = rest[i]
            i += 1
        if not known:
            continue
        tp = _override_type(cls, key)
        if tp is not None and takes_text(tp):
            optional = type(None) in typing.get_args(tp)
            pairs.append((key, None if optional and value in NULL_TEXT else value))
            continue
        try:  # as draccus reads a command-line value (YAML, with the empty text kept as it is)
            parsed = yaml.load(value, SafeLoaderWithInclusion) if value else value
        except (yaml.YAMLError, OSError):
            parsed = value
        if tp is None or _fits(tp, parsed):
            pairs.append((key, parsed))
        elif _fits(tp, value):
            pairs.append((key, value))
        else:
            listed = f" (a list on the command line: '[{value}]')" if _fits(tp, [parsed]) else ""
            out.append(_wrong_type(f"--{key}", tp, parsed, value) + listed)
    return pairs, out


def with_overrides(data: dict, pairs: Sequence[tuple[str, Any]]) -> dict:
    """`data` with each dotted `key: value` of `pairs` set in it, in order (a later one wins); a
    section a key goes into is created, or replaces a value that is not a mapping (`eval: null`)."""
    out = copy.deepcopy(data)
    for key, value in pairs:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return out


def _split_args(argv: Sequence[str]) -> tuple[Optional[str], list[str], list[str]]:
    """(config path, dotted override keys, remaining args for `read_overrides`)."""
    config: Optional[str] = None
    rest: list[str] = []
    keys: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "--config_path"):
            if i + 1 >= len(argv):
                raise ConfigError([f"{arg}: needs a YAML file"], "command line")
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith(("--config=", "--config_path=")):
            config = arg.split("=", 1)[1]
            i += 1
            continue
        if arg.startswith("--") and arg not in ("--help", "-h"):
            keys.append(arg[2:].split("=", 1)[0])
        rest.append(arg)
        i += 1
    return config, keys, rest


def _unknown_override(cls: type, dotted: str) -> Optional[str]:
    parts = dotted.split(".")
    current: Any = cls
    for depth, part in enumerate(parts):
        sub = _dataclass_of(current)
        if sub is None:
            return None  # inside a free-form field: draccus decides
        names = [f.name for f in dataclasses.fields(sub)]
        if part not in names:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            full = f"{prefix}.{close[0]}" if prefix and close else (close[0] if close else "")
            habit = _habit(names, dotted) if depth == 0 else None
            hint = (
                f"; {habit}"
                if habit
                else f"; did you mean '--{full}'?"
                if close
                else f"; known keys here: {', '.join(names)}"
            )
            return f"--{dotted}: unknown option{hint}"
        current = typing.get_type_hints(sub)[part]
    section = None if _list_item_dataclass(current) else _dataclass_of(current)
    if section is not None:  # `--model Qwen/...` (TRL's habit): a section takes its keys, not a value
        first = (
            "path" if "path" in [f.name for f in dataclasses.fields(section)] else dataclasses.fields(section)[0].name
        )
        return f"--{dotted}: is a section, not a value; set its keys, e.g. '--{dotted}.{first}'"
    return None


class ConfigLoader(SafeLoaderWithInclusion):
    """draccus's YAML loader (`!include` relative to the including file, included files read by
    this loader too) that refuses a key given twice in one mapping, which YAML would settle
    silently by keeping the last (`train:` twice: the first one's keys lost)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge (<<) may be overridden by the keys beside it: that is what it is for
                line = key_node.start_mark.line + 1
                if key_node.value in lines:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key_node.value!r} is given twice (lines {lines[key_node.value]} and {line}); "
                        "keep one: YAML would keep only the last",
                        key_node.start_mark,
                    )
                lines[key_node.value] = line
        return super().construct_mapping(node, deep=deep)

    def construct_located_map(self, node):
        """A mapping as `LocatedMap`: where each key was written. A key merged in from an
        `!include` (`<<: !include f.yaml`) has no mark of its own: it is placed at the mapping."""
        data = LocatedMap()
        data.where, data.text = {}, {}
        yield data
        data.update(self.construct_mapping(node))
        for key_node, value_node in node.value:
            mark = key_node.start_mark or node.start_mark
            if isinstance(key_node, yaml.ScalarNode) and mark is not None:
                data.where[self.construct_object(key_node)] = f"{mark.name}:{mark.line + 1}"
            if isinstance(value_node, yaml.ScalarNode) and value_node.tag.startswith("tag:yaml.org,2002:"):
                data.text[self.construct_object(key_node)] = value_node.value


ConfigLoader.add_constructor("tag:yaml.org,2002:map", ConfigLoader.construct_located_map)
ConfigLoader.add_representer(LocatedMap, ConfigLoader.represent_dict)  # `<<: !include` re-represents it


def yaml_problem(path: Path, err: Exception) -> str:
    """One line for a YAML config that cannot be read: the file and line where it breaks (an
    included file's own name where the break is in it), and why."""
    mark = getattr(err, "problem_mark", None)
    if isinstance(err, yaml.MarkedYAMLError) and mark is not None:
        name = mark.name if mark.name and not mark.name.startswith("<") else str(path)
        context = f" ({err.context})" if err.context else ""
        return f"{name}:{mark.line + 1}: {err.problem}{context}"
    if isinstance(err, UnicodeDecodeError):
        return f"{path}: a file it includes is not UTF-8 text"
    if isinstance(err, FileNotFoundError):  # the config itself exists: an !include names no file
        return f"{path}: !include {err.filename}: no such file"
    return f"{path}: {err}".replace("\n", " ")


def plain(data: Any) -> Any:
    """`data` with every mapping a plain dict (a `LocatedMap` is one only to the checks here)."""
    if isinstance(data, dict):
        return {key: plain(value) for key, value in data.items()}
    return [plain(value) for value in data] if isinstance(data, list) else data


def read_yaml(path: Union[str, Path], located: bool = False) -> dict:
    """A YAML config with `!include` resolved relative to the including file, each key at most
    once in a mapping (`ConfigLoader`); with `located`, its mappings are `LocatedMap`s (where each
    key was written), else plain dicts.

    Raises:
        ConfigError: the file is missing, is not UTF-8 text or not YAML, gives a key twice, or is
            not a mapping; one line naming the file (and line).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such config file"])
    try:
        raw = path.read_bytes()
        raw.decode("utf-8")
    except OSError as err:
        raise ConfigError([f"{path}: {err}"]) from err
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError([f"{path}:{line}: not UTF-8 text (byte {err.start}); save the config as UTF-8"]) from err
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=ConfigLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as err:
        raise ConfigError([yaml_problem(path, err)]) from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of keys, got {type(data).__name__}"])
    return data if located else plain(data)


def load_config(
    cls: type[T], argv: Optional[Sequence[str]] = None, prog: Optional[str] = None, *, check: bool = True
) -> T:
    """Build `cls` from `--config FILE.yaml` plus dotted overrides in `argv`.

    Unknown keys in the YAML or on the command line, values of the wrong type, and (with `check`)
    every semantic problem from `cfg.problems()`, are reported together in one ConfigError; without
    `check` the caller gathers `cfg.problems()` with its own checks.

    Raises:
        ConfigError: any problem; its `problems` list has every one.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(config_help(cls, prog or Path(sys.argv[0]).name))
        raise SystemExit(0)
    config_path, override_keys, rest = _split_args(argv)
    problems: list[str] = []
    data = {} if config_path is None else read_yaml(config_path, located=True)
    problems += unknown_keys(cls, data, origin=config_path) + wrong_types(cls, data, origin=config_path)
    problems += [p for p in (_unknown_override(cls, k) for k in override_keys) if p]
    pairs, wrong = read_overrides(cls, rest)
    if problems or wrong:
        raise ConfigError(problems + wrong)
    try:
        cfg = draccus.decode(cls, with_overrides(as_written(cls, data), pairs))
    except Exception as err:  # draccus raises several types for values it cannot decode
        raise ConfigError([decode_problem(err)]) from err
    if check and hasattr(cfg, "problems"):
        found = cfg.problems()
        if found:
            raise ConfigError(found)
    return cfg


def decode_problem(err: Exception) -> str:
    """One line for what draccus could not decode that `wrong_types` did not foresee: the key, then
    its own words (not the exception's class)."""
    key_path = getattr(err, "key_path", None)
    message = str(getattr(err, "message", err)).splitlines()[0]
    return f"{'.'.join(key_path)}: {message}" if key_path else message


def to_dict(cfg: Any) -> dict:
    """The config as plain data (what manifests record and what `--config` would read back)."""
    return draccus.encode(cfg)


def save_config(cfg: Any, path: Union[str, Path]) -> None:
    """Write the resolved config as YAML."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
