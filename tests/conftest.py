"""Shared fixtures: offline environment, the embedded model, tiny random models."""

from __future__ import annotations

import os

from pipeline import cpu_isa

# RELAY_CPU_ISA=avx2 runs the suite as on an AVX2-only CPU: the caps must be set before torch runs.
cpu_isa.apply()
# Nothing may reach a hub at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# As every stage sets it (pipeline.engine.tracking.quiet_console): set once here, the processes a test
# starts see the same value whether or not a stage ran in this process before (tests/forkserver.py).
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")  # likewise: importing lm_eval sets it (tests/test_eval.py)
# The CPU fast paths (oneDNN training linears, prepacked and fused decoding) are taken where a one-time
# measurement says they pay on this machine (pipeline/modeling/cpu_kernels.py), and their results differ
# from torch's plain kernels by float noise: the suite runs the plain ones on every CPU kind, so no
# comparison depends on what this machine measured. The tests of the fast paths turn them on themselves
# (test_decode, test_cpu_kernels, test_ppo); RELAY_CPU_ONEDNN=1 etc. run the whole suite on them.
for _kernel in ("RELAY_CPU_ONEDNN", "RELAY_DECODE_PACKED", "RELAY_DECODE_FUSED"):
    os.environ.setdefault(_kernel, "0")
# The tokenisation cache of this session lives in a temporary folder (not the user's ~/.cache).
if "RELAY_TOKEN_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RELAY_TOKEN_CACHE"] = tempfile.mkdtemp(prefix="relay-test-tokens-")
    atexit.register(shutil.rmtree, os.environ["RELAY_TOKEN_CACHE"], True)

import pytest  # noqa: E402

# Under pytest-xdist (run_scripts/test.sh) the cores are split between the workers: on 2 cores one
# thread each, and the processes a test starts (torchrun, stage scripts, servers) get the same share.
# Two workers of 2 threads on 2 cores would slow each other several-fold.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


def xdist_controller(config) -> bool:
    """Whether this process only hands the tests out to pytest-xdist's workers (runs none itself)."""
    return not os.environ.get("PYTEST_XDIST_WORKER") and bool(config.getoption("numprocesses", None))


def pytest_configure(config):
    """A process that runs tests imports torch here, after the environment set-up above (torch must
    see the CPU caps and offline switches); xdist's controller runs no test and skips the imports:
    they take seconds, and the workers start only after it has loaded this file."""
    if xdist_controller(config):
        return
    import bitsandbytes  # noqa: F401  (a stage run hides backends the config does not ask for; this session keeps both)
    import tinymodels  # noqa: F401  (transformers, for every test module)
    import torch

    torch.set_num_threads(_THREADS)


def pytest_collection_finish(session):
    """Everything alive once the test modules are imported (torch, transformers, the stages, the
    collected items) lives for the whole session: `gc.freeze` moves it out of the collector's
    reach. Every stage run's export calls accelerate's `free_memory`, whose full `gc.collect` then
    scans the objects of that run instead of the ~0.5 M of the imports (0.2-0.7 s a run before)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def embedded_path():
    """The embedded SmolLM2-135M-Instruct folder (converted once, then cached)."""
    from pipeline.modeling.embedded import materialize

    return materialize()


@pytest.fixture(scope="module")
def llama_cpp():
    """llama.cpp's reader of GGUF files (tests/llamacpp.py), or the test skips saying why it is missing."""
    import llamacpp

    reason = llamacpp.why_unavailable()
    if reason:
        pytest.skip(reason)
    return llamacpp.LlamaCpp


@pytest.fixture(scope="module")
def module_folder(request, tmp_path_factory):
    """A folder for a module's shared runs, removed when the module ends with none of its tests
    failed: pyproject's retention policy removes a passing test's own `tmp_path` at once, but a
    module-wide folder of model runs would otherwise stay until the whole run ends."""
    import shutil

    folder = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    failed = request.session.testsfailed
    yield folder
    if request.session.testsfailed == failed:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random causal LM (2 layers, d=64) with the embedded tokenizer. Read-only: copy it
    before changing it."""
    from tinymodels import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "causal", seed=0)


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory):
    """A tiny random sequence classifier (num_labels=1) with the embedded tokenizer."""
    from tinymodels import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "reward", seed=1, num_labels=1)


LAST_MODULES = ("test_vllm.py",)
"""In one process, run after everything else: run_scripts/test.sh builds vLLM's side environment in the background
while the rest of the suite runs, and these tests wait for it (tests/test_vllm.py)."""


LONGEST_FIRST = (
    "test_driver.py",
    "test_zero_cpu.py",
    "test_bench.py",
    "test_fsdp.py",
    "test_vllm.py",
    "test_cells_ddp.py",
    "test_distributed_stages.py",
    "test_signals.py",
    "test_decode.py",
    "test_reward.py",
    "test_cells.py",
    "test_distill.py",
    "test_multinode.py",
    "test_tool_rollout.py",
    "test_pt_sft.py",
    "test_eval.py",
)
"""The order of the modules in xdist workers (run_scripts/test.sh runs `--dist loadfile
--no-loadscope-reorder`: a module to a worker, handed out in collection order): the longest first
(by `--durations`), so that two workers end together instead of one finishing a long module alone;
the rest follow in their usual order. The vLLM modules come after a few long ones: the background
install of their environment has finished by then."""


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    else:
        items.sort(key=lambda item: item.path.name in LAST_MODULES)  # stable: the order within each part is kept
