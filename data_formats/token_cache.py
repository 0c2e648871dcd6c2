"""A disk cache of tokenised training data: a second run of a stage (or a resume) reads what its
data builder produced last time instead of reading, validating and tokenising the data again.

    RELAY_TOKEN_CACHE=off relay sft configs/sft.yaml      # build without the cache
    RELAY_TOKEN_CACHE=/fast/disk/tokens relay sft ...     # keep the entries elsewhere

Entries live in $RELAY_TOKEN_CACHE when it names a folder, else in Relay's cache folder
($RELAY_CACHE/tokens, default ~/.cache/relay/tokens, beside the converted embedded model). The
switch is an environment setting, not a config key, because a cache never changes what a stage
trains on: the stage config is the run's identity (resume compares it), and a cache setting has
no place there.

The key is a sha256 over everything that decides a builder's output (`key_parts`):
- the builder's name and FORMAT_VERSION, a sha256 of data_formats' own source files, its
  subpackages' included (a change to parsing, rendering or the builders invalidates every entry),
  the transformers and tokenizers versions;
- the split, the data config section as a dict (entries, format, on_error, truncation,
  eval_fraction, max_samples, ...), and the builder's own arguments (seq_length, the template,
  `tasks`, the prompt length limit);
- each data file the split reads, as listed (samples carry it in `source`), with its resolved
  path, size, mtime_ns and the sha256 of its bytes. The content is hashed because size and mtime
  alone can lie: `cp -p`, `rsync -t` and `tar x` give another file the old size and mtime, and a
  same-size rewrite within one timestamp tick keeps both. Hashing runs at about 1 GB/s, a few
  seconds for a corpus whose tokenisation takes most of an hour (and the resume check already
  reads every byte of the training files);
- the tokenizer (`tokenizer_fingerprint`): its backend's serialised form (vocabulary, merges,
  normaliser, pre-tokeniser, post-processor, added and special tokens), its special tokens, chat
  template and decode setting. A chat template that reads the clock (`strftime_now`) adds today's
  date.

Not cached (built as before, said once in the log): splits that read a hub dataset by name (no
cheap identity) and tokenizers without a serialisable backend (slow, pure-Python ones).

Bad records: an entry keeps the problems every policy check saw, and a hit replays them through
`apply_policy`, so on_error=skip logs the same lines and the builder returns the same stats.
(on_error=strict with a problem raises before anything is stored.)

Storage: one numpy .npz per key, read with allow_pickle=False (nothing is ever unpickled): each
column of the samples as flat arrays (lists of ints flattened with offsets, strings as UTF-8 with
offsets) and one JSON block (the key, the columns, the builder's stats, the problems). An entry
is written to a temporary file beside its place and renamed into it, so a reader never sees half
an entry; ranks that build the same data at once write identical bytes and the last rename wins.
An entry that cannot be read (truncated, corrupt, another format, another key) is a miss: the
data is built again and the entry overwritten, never an error. Entries are never evicted; delete
the folder to reclaim the space.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from data_formats.cache import cache_root
from data_formats.sources import Problem, expand_entry
from data_formats.validate import apply_policy

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump when what a builder returns, or how an entry is stored, changes shape."""
ENV = "RELAY_TOKEN_CACHE"
OFF = ("0", "off", "false", "no")
_HASH_BLOCK = 1 << 20


@dataclass
class Built:
    """What a data builder produced: its samples, what it reports beside them (JSON values), and
    the problems each policy check saw, in order, as (what, problems)."""

    samples: list[dict]
    info: dict = field(default_factory=dict)
    problems: list[tuple[str, list[Problem]]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The key
# --------------------------------------------------------------------------------------------


PACKAGE = Path(__file__).parent


@lru_cache(maxsize=4)
def code_fingerprint(root: Path = PACKAGE) -> str:
    """sha256 of the source files under `root` (data_formats' own, its subpackages' too: the
    format registry lives in data_formats/formats), by path relative to `root` and bytes, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    """The versions of the libraries that tokenise and render chat templates."""
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def file_fingerprint(path: Path) -> dict:
    """A data file's identity: as listed, resolved, size, mtime_ns and the sha256 of its bytes
    (why the bytes: the module docstring). A missing file is named as missing.

    Raises:
        OSError: the file exists but cannot be read.
    """
    if not path.is_file():
        return {"path": str(path), "missing": True}
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            digest.update(block)
    return {
        "path": str(path),
        "resolved": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": digest.hexdigest(),
    }


def entries_fingerprint(entries: Iterable[str]) -> Optional[list]:
    """[entry, [file fingerprints]] per data path entry, in order; None when an entry is a hub
    dataset (no cheap identity: such a split is not cached).

    Raises:
        OSError: a data file exists but cannot be read.
    """
    out = []
    for entry in entries:
        files, dataset = expand_entry(entry)
        if dataset is not None:
            return None
        out.append([entry, [file_fingerprint(f) for f in files]])
    return out


def tokenizer_fingerprint(tokenizer) -> Optional[str]:
    """sha256 of what decides how a tokenizer encodes, decodes and renders chat: its backend's
    serialised form (vocabulary, merges, normaliser, pre-tokeniser, post-processor, added
    tokens), special tokens, chat template and decode setting; None when it has no serialisable
    backend (a slow tokenizer: not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    template = getattr(tokenizer, "chat_template", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str(),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": template,
        "clean_up_tokenization_spaces": getattr(tokenizer, "clean_up_tokenization_spaces", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def config_dict(cfg) -> dict:
    """A data config section (a dataclass, or any object with attributes) as a plain dict."""
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))


def _as_json(value: Any) -> Any:
    """Dataclasses (a Template) as dicts; everything else as is."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def key_parts(builder: str, split: str, cfg, entries: list[str], tokenizer, **args) -> Optional[dict]:
    """Everything that decides `builder`'s output (module docstring), or None when the build
    cannot be cached (a hub dataset entry, an unreadable data file, a tokenizer without a
    serialisable backend)."""
    tokenizer_hash = tokenizer_fingerprint(tokenizer)
    if tokenizer_hash is None:
        log.info("token cache: not used (the tokenizer %s has no serialisable backend)", type(tokenizer).__name__)
        return None
    try:
        files = entries_fingerprint(entries)
    except OSError as err:  # the builder reports an unreadable file as it always has
        log.info("token cache: not used for %s %s data (%s)", builder, split, err)
        return None
    if files is None:
        log.info("token cache: not used for %s %s data (it reads a hub dataset)", builder, split)
        return None
    args = {k: _as_json(v) for k, v in args.items()}
    templates = json.dumps(args, default=str) + str(getattr(tokenizer, "chat_template", ""))
    # A template that prints today's date renders differently tomorrow.
    date = str(datetime.date.today()) if "strftime_now" in templates else None
    return {
        "format": FORMAT_VERSION,
        "builder": builder,
        "code": code_fingerprint(),
        "libraries": library_versions(),
        "split": split,
        "config": config_dict(cfg),
        "args": args,
        "files": files,
        "tokenizer": tokenizer_hash,
        "date": date,
    }


def cache_key(parts: dict) -> str:
    """sha256 of the key parts as canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def cache_folder() -> Optional[Path]:
    """Where entries live (module docstring), or None when $RELAY_TOKEN_CACHE turns the cache off."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    return cache_root() / "tokens"


# --------------------------------------------------------------------------------------------
# Samples <-> arrays
# --------------------------------------------------------------------------------------------


def _column_kind(values: list) -> Optional[str]:
    """'int', 'float', 'str' or 'ints' (a list of ints) when every value is one; else None."""
    for kind, test in (
        ("int", lambda v: type(v) is int),
        ("float", lambda v: type(v) is float),
        ("str", lambda v: type(v) is str),
    ):
        if all(test(v) for v in values):
            return kind
    if all(type(v) is list and all(type(x) is int for x in v) for v in values):
        return "ints"
    return None


def _offsets(lengths: Iterable[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.fromiter(lengths, dtype=np.int64))]).astype(np.int64)


def encode_column(values: list, kind: str) -> dict[str, np.ndarray]:
    """One column as arrays: 'values' (and 'offsets' for lists and strings)."""
    if kind == "int":
        return {"values": np.array(values, dtype=np.int64)}
    if kind == "float":
        return {"values": np.array(values, dtype=np.float64)}
    if kind == "str":
        encoded = [v.encode("utf-8") for v in values]
        return {"values": np.frombuffer(b"".join(encoded), dtype=np.uint8), "offsets": _offsets(map(len, encoded))}
    total = sum(map(len, values))
    flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=total)
    small = total == 0 or (flat.min() >= np.iinfo(np.int32).min and flat.max() <= np.iinfo(np.int32).max)
    return {"values": flat.astype(np.int32) if small else flat, "offsets": _offsets(map(len, values))}


def decode_column(arrays: dict[str, np.ndarray], kind: str) -> list:
    """The inverse of `encode_column` (plain Python ints, floats and strings).

    Raises:
        ValueError: unknown kind.
    """
    values = arrays["values"]
    if kind in ("int", "float"):
        return values.tolist()
    offsets = arrays["offsets"].tolist()
    if kind == "str":
        blob = values.tobytes()
        return [blob[a:b].decode("utf-8") for a, b in zip(offsets, offsets[1:])]
    if kind == "ints":
        flat = values.tolist()
        return [flat[a:b] for a, b in zip(offsets, offsets[1:])]
    raise ValueError(f"unknown column kind {kind!r}")


def encode_samples(samples: list[dict]) -> Optional[tuple[list[list[str]], dict[str, np.ndarray]]]:
    """([[name, kind], ...], arrays) for samples that share their keys and whose values are ints,
    floats, strings or lists of ints; None for anything else (not cached)."""
    names = list(samples[0]) if samples else []
    if any(list(s) != names for s in samples):
        return None
    columns, arrays = [], {}
    for i, name in enumerate(names):
        values = [s[name] for s in samples]
        kind = _column_kind(values)
        if kind is None:
            return None
        columns.append([name, kind])
        arrays.update({f"c{i}.{part}": a for part, a in encode_column(values, kind).items()})
    return columns, arrays


def decode_samples(columns: list[list[str]], arrays, count: int) -> list[dict]:
    """The samples `encode_samples` stored (`count` of them)."""
    decoded = []
    for i, (name, kind) in enumerate(columns):
        parts = {part: arrays[f"c{i}.{part}"] for part in ("values", "offsets") if f"c{i}.{part}" in arrays}
        decoded.append((name, decode_column(parts, kind)))
    return [{name: values[j] for name, values in decoded} for j in range(count)]


# --------------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------------


def write_entry(path: Path, key: str, built: Built) -> bool:
    """Store `built` under `path` atomically (temporary file + rename); False when its samples
    cannot be stored (see `encode_samples`) or the folder cannot be written (logged, not raised:
    a cache that cannot be written only costs the next run its time)."""
    encoded = encode_samples(built.samples)
    if encoded is None:
        log.info("token cache: these samples cannot be stored; not cached")
        return False
    columns, arrays = encoded
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "count": len(built.samples),
        "columns": columns,
        "info": built.info,
        "problems": [[what, [[p.file, p.line, p.reason] for p in problems]] for what, problems in built.problems],
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache folder serves every user
        os.replace(tmp, path)
        return True
    except OSError as err:
        log.warning("token cache: could not write %s (%s); the next run tokenises again", path, err)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return False


def load_entry(path: Path, key: str) -> Optional[Built]:
    """The entry at `path` when it is whole and was stored under `key`; None otherwise (missing,
    truncated, corrupt, another format or key: a miss, never an error)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as arrays:
            meta = json.loads(bytes(arrays["meta"]).decode("utf-8"))
            if meta.get("format") != FORMAT_VERSION or meta.get("key") != key:
                raise ValueError("stored under another key or format")
            loaded = {name: arrays[name] for name in arrays.files if name != "meta"}
        samples = decode_samples(meta["columns"], loaded, meta["count"])
        problems = [(what, [Problem(f, int(n), r) for f, n, r in items]) for what, items in meta["problems"]]
        return Built(samples, meta["info"], problems)
    except Exception as err:  # any failure to read a cache entry is a miss: the data is built again
        log.warning(
            "token cache: ignoring unreadable entry %s (%s: %s); tokenising again", path, type(err).__name__, err
        )
        return None


Check = Callable[[list[Problem], str], None]
"""check(problems, what): apply the on_error policy to `problems` (see `build_cached`)."""


def build_cached(
    parts: Callable[[], Optional[dict]], on_error: str, build: Callable[[Check], Built], what: str
) -> Built:
    """`build(check)` through the cache, keyed by `parts()` (see `key_parts`; called only when the
    cache is on). `build` calls `check(problems, what)` wherever it applies the on_error policy; a
    hit replays those checks (the same log lines) instead of building. When the cache is off or
    `parts()` is None, `build` runs every time.

    Raises:
        DataError: bad records with on_error='strict' (from `build`).
    """
    folder = cache_folder()
    found = parts() if folder is not None else None
    key = cache_key(found) if found is not None else None
    path = folder / f"{key}.npz" if key is not None else None
    if path is not None:
        hit = load_entry(path, key)
        if hit is not None:
            for check_what, problems in hit.problems:
                apply_policy(problems, on_error, check_what)
            log.info("%s: read from the token cache (%s)", what, path)
            return hit
    checks: list[tuple[str, list[Problem]]] = []

    def check(problems: list[Problem], check_what: str) -> None:
        apply_policy(problems, on_error, check_what)
        checks.append((check_what, list(problems)))

    built = build(check)
    built.problems = checks
    if path is not None and write_entry(path, key, built):
        log.info("%s: written to the token cache (%s)", what, path)
    return built
