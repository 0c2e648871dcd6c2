"""`relay bundle`: the wheels Relay needs on top of an existing CUDA PyTorch environment, for an
offline GPU node (an air-gapped cluster whose image already has CUDA torch).

    relay bundle --out .whl [--python-version 3.12] [--budget-mib N]    # download + build + manifest
    relay bundle --check .whl                                             # is a bundle complete?

The node is assumed to hold CUDA torch, transformers, accelerate, peft and the common scientific
stack (IMAGE_HAS: the GPU image's package list). The bundle is NEEDS plus every dependency of
theirs, followed transitively through the wheels' own metadata, that the image does not hold.
Versions are the ones installed in the Python running this command where it has the package
(the versions CI tests with), else the newest. DeepSpeed ships only as an sdist: it is built here
into a pure-Python wheel with DS_BUILD_OPS=0 (its CUDA ops are JIT-built on the node when used), as
are the few pure-Python dependencies published only as an sdist (SDIST_ONLY).
`bundle.json` lists every file with its version, sha256 and size; install it with
`bash run_scripts/install.sh --bundle DIR` (never replaces torch: `--no-deps`, no index).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from pipeline.modeling.embedded import COMPLETE_MARKER, embedded_dir, materialize
from pipeline.modeling.manifest import file_sha256

NEEDS = ("bitsandbytes", "datasets", "trl", "draccus", "deepspeed", "gguf", "fastapi", "uvicorn")
"""What Relay imports that a CUDA PyTorch image lacks: pyproject.toml's dependencies minus IMAGE_HAS."""
EVAL_NEEDS = ("lm-eval",)
"""pyproject.toml's `eval` extra (`relay eval`, the pipelines' gold.benchmarks; install.sh installs it too):
bundled unless `--without-eval` leaves it out (the manifest then says so, and `check` does not ask for it)."""
DEV_NEEDS = ("pytest", "pytest-timeout")
"""What run_scripts/gpu_check.sh runs the tests with."""
SDIST_ONLY = {
    "deepspeed": {"DS_BUILD_OPS": "0", "DS_SKIP_CUDA_CHECK": "1"},
    # lm-eval's pure-Python dependencies that publish no wheel
    "rouge-score": {},
    "sqlitedict": {},
    "word2number": {},
}
"""Packages published only as an sdist, built here into a wheel with these environment settings."""
NEVER_BUNDLED = frozenset({"torch", "transformers", "accelerate", "peft", "triton", "tokenizers", "safetensors"})
"""The node's own ML stack: a bundle that held one would replace it, so building one refuses."""
IMAGE_HAS = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split()
)
"""The Python packages a CUDA cluster image typically has (torch, transformers, accelerate, peft and
their dependencies): the bundle leaves these out."""
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MANIFEST = "bundle.json"
TOKENIZER = "embedded-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""The embedded model's tokenizer (3.4 MB); its weights (the 90 MB GGUF) do not fit the carry, and the
GPU tests train tiny random models that only need the tokenizer."""
TOKENIZER_ONLY = "TOKENIZER_ONLY"


class BundleError(RuntimeError):
    """A bundle that cannot be built or is incomplete (one line for the user)."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Wheel:
    """One file of a bundle: which package and version, who needed it, and its bytes' identity."""

    name: str
    version: str
    file: str
    sha256: str
    size: int
    required_by: list[str] = field(default_factory=list)


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) read from a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    headers = text.split("\n\n", 1)[0].splitlines()
    value = lambda key: next(line.split(":", 1)[1].strip() for line in headers if line.startswith(key + ":"))
    return (
        value("Name"),
        value("Version"),
        [line.split(":", 1)[1].strip() for line in headers if line.startswith("Requires-Dist:")],
    )


def target_environment(python_version: str) -> dict[str, str]:
    """The marker environment of the node (CPython on x86-64 Linux)."""
    major, minor = python_version.split(".")[:2]
    return {
        "python_version": f"{major}.{minor}",
        "python_full_version": f"{major}.{minor}.0",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def needed_requirements(requires: list[str], extras: set[str], env: dict[str, str]) -> list[tuple[str, set[str], str]]:
    """(name, extras, specifier) of the Requires-Dist lines that apply on the node with `extras` asked."""
    from packaging.requirements import Requirement

    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in ({""} | extras)):
            continue
        out.append((canonical(req.name), set(req.extras), str(req.specifier)))
    return out


def pinned(name: str, specifier: str) -> str:
    """`name==installed` where this Python has a version that satisfies `specifier`, else `name<specifier>`."""
    from packaging.specifiers import SpecifierSet

    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return name + specifier
    return f"{name}=={version}" if SpecifierSet(specifier).contains(version, prereleases=True) else name + specifier


def pip(args: list[str], env: Optional[dict] = None) -> None:
    """Run pip; its last lines become the error.

    Raises:
        BundleError: pip failed.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-2:]
        raise BundleError(f"pip {' '.join(args[:2])} {args[-1]}: " + " | ".join(tail))


def fetch(requirement: str, name: str, out: Path, python_version: str) -> Path:
    """Download `requirement`'s wheel for the node into `out` (building it when it is SDIST_ONLY)."""
    before = set(out.iterdir())
    if name in SDIST_ONLY:
        with tempfile.TemporaryDirectory() as tmp:
            pip(["download", "--no-deps", "--no-binary", ":all:", "-d", tmp, requirement])
            sdist = next(Path(tmp).iterdir())
            # No build isolation: DeepSpeed's setup.py imports torch, which an isolated build lacks.
            pip(["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist)], env=SDIST_ONLY[name])
    else:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        pip(
            [
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--implementation",
                "cp",
                "--python-version",
                python_version,
                *platforms,
                "-d",
                str(out),
                requirement,
            ]
        )
    new = [p for p in set(out.iterdir()) - before if p.suffix == ".whl"]
    if len(new) != 1:
        raise BundleError(f"{requirement}: expected one new wheel in {out}, found {len(new)}")
    return new[0]


def build(
    out: Path,
    python_version: str = "3.12",
    needs: Sequence[str] = NEEDS + EVAL_NEEDS + DEV_NEEDS,
    image_has: frozenset = IMAGE_HAS,
    without: Sequence[str] = (),
) -> dict:
    """Download (and build) the closure of `needs` minus `image_has` into `out`; write the manifest
    (`without`: the extras left out, recorded for `check`).

    Raises:
        BundleError: a download or build failed, or the closure reaches a NEVER_BUNDLED package.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = target_environment(python_version)
    wheels: dict[str, Wheel] = {}
    provided: dict[str, list[str]] = {}
    queue: list[tuple[str, set[str], str, str]] = [(canonical(n), set(), "", "relay") for n in needs]
    while queue:
        name, extras, specifier, parent = queue.pop(0)
        if name in image_has and name not in needs:
            provided.setdefault(name, []).append(parent)
            continue
        if name in NEVER_BUNDLED:
            raise BundleError(f"{parent} needs {name}, which the node's own stack must provide (never bundled)")
        if name in wheels:
            wheels[name].required_by.append(parent)
            continue
        existing = [p for p in out.glob("*.whl") if canonical(p.name.split("-")[0]) == name]
        path = existing[0] if existing else fetch(pinned(name, specifier), name, out, python_version)
        real_name, version, requires = wheel_metadata(path)
        wheels[name] = Wheel(canonical(real_name), version, path.name, file_sha256(path), path.stat().st_size, [parent])
        queue += [(n, e, s, name) for n, e, s in needed_requirements(requires, extras, env)]
    manifest = {
        "python_version": python_version,
        "platforms": list(PLATFORMS),
        "needs": list(needs),
        "without": list(without),
        "wheels": [asdict(w) for w in sorted(wheels.values(), key=lambda w: w.name)],
        "provided_by_image": {k: sorted(set(v)) for k, v in sorted(provided.items())},
        "total_bytes": sum(w.size for w in wheels.values()),
    }
    stray = sorted(p.name for p in out.glob("*.whl") if p.name not in {w.file for w in wheels.values()})
    if stray:
        raise BundleError(
            f"{out} holds wheels the bundle does not need ({', '.join(stray)}): remove them or use an empty folder"
        )
    manifest["files"] = copy_tokenizer(out)
    manifest["total_bytes"] += sum(f["size"] for f in manifest["files"])
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def copy_tokenizer(out: Path) -> list[dict]:
    """Copy the embedded model's tokenizer files into out/TOKENIZER; their manifest entries."""
    source, folder = materialize(), out / TOKENIZER
    folder.mkdir(exist_ok=True)
    entries = []
    for name in TOKENIZER_FILES:
        data = (source / name).read_bytes()
        (folder / name).write_bytes(data)
        entries.append({"file": f"{TOKENIZER}/{name}", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    return entries


def seed_cache(bundle: Path) -> Path:
    """Make the bundle's tokenizer the embedded model folder of $RELAY_CACHE, marked TOKENIZER_ONLY:
    tests/tinymodels.py builds its tiny random models on it; loading the embedded weights fails
    (there are none). Use a cache of its own (gpu_check.sh does), never the user's."""
    target = embedded_dir()
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (target / name).write_bytes((bundle / TOKENIZER / name).read_bytes())
    (target / TOKENIZER_ONLY).write_text("the embedded model's tokenizer only, from a relay bundle; no weights\n")
    (target / COMPLETE_MARKER).write_text("ok\n")
    return target


def check(folder: Path, budget_mib: Optional[float] = None, needs: Optional[Sequence[str]] = None) -> list[str]:
    """Every problem of the bundle in `folder` (empty: complete): a missing manifest, a need it
    lacks, a file missing or changed (size, sha256), two versions of one package, over budget.
    `needs` defaults to NEEDS, DEV_NEEDS and, unless the bundle was built `--without-eval`, EVAL_NEEDS."""
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{path}: no bundle manifest (build one: relay bundle --out {folder})"]
    manifest = json.loads(path.read_text())
    if needs is None:
        needs = NEEDS + DEV_NEEDS + (() if "eval" in manifest.get("without", []) else EVAL_NEEDS)
    problems = []
    names = [w["name"] for w in manifest["wheels"]]
    problems += [f"{path}: {n} is needed but not in the bundle" for n in map(canonical, needs) if n not in names]
    problems += [
        f"{path}: {n} appears twice (one version each, or pip refuses the install)"
        for n in sorted({n for n in names if names.count(n) > 1})
    ]
    for wheel in manifest["wheels"] + manifest.get("files", []):
        file = folder / wheel["file"]
        if not file.is_file():
            problems.append(f"{file}: missing" + (f" ({wheel['name']} {wheel['version']})" if "name" in wheel else ""))
        elif file.stat().st_size != wheel["size"] or file_sha256(file) != wheel["sha256"]:
            problems.append(f"{file}: size or sha256 differs from {MANIFEST}")
    total = sum(w["size"] for w in manifest["wheels"] + manifest.get("files", []))
    if budget_mib is not None and total > budget_mib * 2**20:
        problems.append(f"{path}: {total / 2**20:.1f} MiB is over the budget of {budget_mib:g} MiB")
    return problems


def tree_bytes(repo: Path) -> Optional[int]:
    """Bytes of the source tree that travels to the node beside a bundle: the files git tracks plus the
    untracked ones it does not ignore (None outside a git checkout)."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True
    )
    if proc.returncode != 0:
        return None
    files = [repo / name for name in proc.stdout.decode().split("\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file())


def summary(manifest: dict) -> str:
    """The bundle's contents, one line per wheel, and its total."""
    lines = [
        f"  {w['name']:<22} {w['version']:<14} {w['size'] / 2**20:7.2f} MiB  (for "
        f"{', '.join(sorted(set(w['required_by'])))})"
        for w in manifest["wheels"]
    ]
    lines += [f"  {f['file']:<37} {f['size'] / 2**20:7.2f} MiB" for f in manifest.get("files", [])]
    return "\n".join(
        lines
        + [
            f"  total {manifest['total_bytes'] / 2**20:.2f} MiB: {len(manifest['wheels'])} wheels, "
            f"{len(manifest.get('files', []))} tokenizer files"
        ]
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relay bundle", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", help="folder to write the wheels and bundle.json into")
    parser.add_argument("--check", metavar="DIR", help="check an existing bundle instead of building one")
    parser.add_argument(
        "--seed-cache", metavar="DIR", help="make DIR's tokenizer the embedded model of $RELAY_CACHE (tokenizer only)"
    )
    parser.add_argument("--python-version", default="3.12", help="the node's CPython version (default 3.12)")
    parser.add_argument(
        "--without-eval",
        action="store_true",
        help="leave out the eval extra (lm-eval: relay eval and gold.benchmarks), for a smaller transfer",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="optional: refuse a bundle larger than this "
        "many MiB (for a transfer with a size limit; default: no limit)",
    )
    args = parser.parse_args(argv)
    if args.seed_cache:
        print(seed_cache(Path(args.seed_cache)))
        return 0
    if bool(args.out) == bool(args.check):
        parser.error("give exactly one of --out DIR, --check DIR or --seed-cache DIR")
    try:
        if args.out:
            without = ["eval"] if args.without_eval else []
            needs = NEEDS + DEV_NEEDS + (() if without else EVAL_NEEDS)
            manifest = build(Path(args.out), args.python_version, needs, without=without)
            print(f"{args.out}: bundle for CPython {args.python_version} on manylinux x86_64\n{summary(manifest)}")
        folder = Path(args.out or args.check)
        problems = check(folder, args.budget_mib)
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems and args.check:
        print(f"{folder}: bundle complete\n{summary(json.loads((folder / MANIFEST).read_text()))}")
    tree = tree_bytes(Path(__file__).resolve().parents[2])
    if not problems and tree is not None:
        total = json.loads((folder / MANIFEST).read_text())["total_bytes"] + tree
        print(f"  with Relay's tree ({tree / 2**20:.1f} MiB): {total / 2**20:.1f} MiB in all")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
