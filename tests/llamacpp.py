"""llama.cpp itself, through the prebuilt `llama-cpp-cffi` wheel, as an independent GGUF reader.

The wheel is optional (291 MB, and it pins transformers<5, so it is installed with --no-deps:
`pip install --no-deps llama-cpp-cffi cffi`); tests using it skip when it is missing. Its CPU
library was built with GCC 14 and references `__cxa_call_terminate`, which Debian 12's libstdc++
(GCC 12) lacks: we compile that one function (what GCC 14's runtime does: begin the catch, then
std::terminate) into a small shared library with the system compiler and load it first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

SHIM = """
extern void *__cxa_begin_catch(void *);
extern void _ZSt9terminatev(void) __attribute__((noreturn));
void __cxa_call_terminate(void *exc) { if (exc) __cxa_begin_catch(exc); _ZSt9terminatev(); }
"""
_lib = None


def why_unavailable() -> str | None:
    """None when llama.cpp can be loaded here, else why not (the skip reason)."""
    if importlib.util.find_spec("llama") is None or importlib.util.find_spec("_cffi_backend") is None:
        return "llama.cpp binding not installed (pip install --no-deps llama-cpp-cffi cffi)"
    try:
        load()
    except (OSError, ImportError, subprocess.CalledProcessError) as err:
        return f"llama.cpp binding does not load here: {err}"
    return None


def load():
    """(lib, ffi) of llama.cpp's CPU build, logging silenced, backend initialised."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        from llama._llama_cpp_cpu import ffi, lib  # type: ignore[import-not-found]
    except ImportError as err:
        if "__cxa_call_terminate" not in str(err) or shutil.which("cc") is None:
            raise
        folder = Path(tempfile.mkdtemp(prefix="relay-llamacpp-shim-"))
        (folder / "shim.c").write_text(SHIM)
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-o", str(folder / "libshim.so"), str(folder / "shim.c"), "-lstdc++"],
            check=True,
            capture_output=True,
        )
        ctypes.CDLL(str(folder / "libshim.so"), mode=ctypes.RTLD_GLOBAL)
        from llama._llama_cpp_cpu import ffi, lib  # type: ignore[import-not-found]
    quiet = ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda level, text, data: None)
    lib.llama_log_set(quiet, ffi.NULL)
    lib.llama_backend_init()
    _lib = (lib, ffi, quiet)  # the callback must outlive every call
    return _lib


class LlamaCpp:
    """One GGUF loaded by llama.cpp: its tokenizer, metadata and greedy decoding."""

    def __init__(self, path: str | Path, n_ctx: int = 512):
        self.lib, self.ffi, _ = load()
        params = self.lib.llama_model_default_params()
        self.model = self.lib.llama_model_load_from_file(str(path).encode(), params)
        if self.model == self.ffi.NULL:
            raise OSError(f"llama.cpp could not load {path}")
        self.vocab = self.lib.llama_model_get_vocab(self.model)
        cparams = self.lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_threads, cparams.n_threads_batch = n_ctx, n_ctx, 1, 1
        self.ctx = self.lib.llama_init_from_model(self.model, cparams)
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def meta(self, key: str) -> str | None:
        buf = self.ffi.new("char[]", 4096)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, 4096)
        return None if n < 0 else self.ffi.string(buf).decode()

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids as llama.cpp's tokenizer gives them (parse_special: markers in the text are
        their special tokens, as HF tokenizers match added tokens)."""
        data = text.encode()
        out = self.ffi.new("llama_token[]", len(data) + 8)
        n = self.lib.llama_tokenize(self.vocab, data, len(data), out, len(data) + 8, add_special, parse_special)
        return [out[i] for i in range(n)]

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def logits(self, ids: list[int]):
        """Next-token logits (numpy, float32) after `ids` (a fresh sequence)."""
        self.lib.llama_kv_self_clear(self.ctx)
        self._decode(ids)
        return self._last_logits().copy()

    def _last_logits(self):
        import numpy as np

        row = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.frombuffer(self.ffi.buffer(row, 4 * self.n_vocab), dtype=np.float32)

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of `ids` (stopping after an end-of-generation token)."""
        self.lib.llama_kv_self_clear(self.ctx)
        self._decode(ids)
        new: list[int] = []
        while len(new) < max_new_tokens:
            token = int(self._last_logits().argmax())
            new.append(token)
            if self.is_eog(token):
                break
            self._decode([token])
        return new

    def _decode(self, ids: list[int]) -> None:
        buf = self.ffi.new("llama_token[]", ids)
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(buf, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")


# ------------------------------------------------------------------------------------------
# llama.cpp's server (`llama-server --jinja`): its own chat-template engine, tools included
# ------------------------------------------------------------------------------------------

SERVER_ENV = "RELAY_LLAMA_SERVER"
"""Path of a `llama-server` binary (else `llama-server` on PATH). PyPI has no prebuilt one; it is
built from llama.cpp's source (e.g. the copy vendored in llama-cpp-python's sdist:
`cmake -S vendor/llama.cpp -B build -DLLAMA_OPENSSL=OFF && cmake --build build --target llama-server`)."""


def server_binary() -> str | None:
    """The llama-server to use, or None where there is none."""
    import os

    given = os.environ.get(SERVER_ENV)
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("llama-server")


class LlamaServer:
    """`llama-server --jinja` on one GGUF, on a free loopback port: the chat template is rendered by
    llama.cpp's own Jinja engine (POST /apply-template, OpenAI messages and tools) and tokenized by
    its tokenizer (POST /tokenize)."""

    def __init__(self, binary: str, gguf: str | Path, timeout: float = 120.0):
        import socket
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="relay-llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(gguf),
                "--jinja",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "-c",
                "1024",
                "-t",
                "1",
                "--no-webui",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not start; its log: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.2)

    def post(self, path: str, body: dict) -> dict:
        import json
        import urllib.request

        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    def apply_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str:
        body: dict = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = tools
        return self.post("/apply-template", body)["prompt"]

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
