"""Serve a model folder on an OpenAI-compatible HTTP API.

    relay serve outputs/demo/ppo/merged --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "relay", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

With vLLM installed (`--backend auto` or `vllm`) this runs vLLM's own OpenAI server on the folder
(batched, fast, GPU). Otherwise a minimal transformers server from the standard library answers
`GET /v1/models` and `POST /v1/chat/completions` (non-streaming; one request at a time), prompting
through the folder's own chat template exactly as `relay chat` does. Any OpenAI client works:
`OpenAI(base_url="http://localhost:8000/v1", api_key="unused")`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Sequence


class RequestError(ValueError):
    """A request the server refuses (400), with the reason for the client."""


def completion_request(body: Any, default_max_tokens: int) -> tuple[list[dict], dict]:
    """(messages, generation settings) of a /v1/chat/completions body (pure).

    Raises:
        RequestError: no messages, a malformed message, or `stream: true` (not supported here).
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] must be {{'role': system|user|assistant, 'content': str}}")
    if body.get("stream"):
        raise RequestError("'stream': true is not supported by the transformers backend (use vLLM for streaming)")
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    settings = {"max_new_tokens": int(max_tokens), "temperature": float(body.get("temperature", 0.0) or 0.0),
                "top_p": float(body.get("top_p", 1.0) or 1.0)}
    return [{"role": m["role"], "content": m["content"]} for m in messages], settings


def completion_response(model: str, text: str, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> dict:
    """An OpenAI chat.completion object (pure)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def answer(chat, messages: list[dict], settings: dict) -> tuple[str, int, int, str]:
    """(text, prompt tokens, completion tokens, finish reason) of one chat completion."""
    import torch

    from pipeline.tools.chat import Generation, prompt_ids

    gen = Generation(max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"], top_p=settings["top_p"])
    ids = torch.tensor([prompt_ids(chat.tokenizer, messages)])
    with torch.no_grad():
        out = chat.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=chat.tokenizer.pad_token_id,
                                  **gen.kwargs())
    new = out[0, ids.shape[1]:]
    eos = chat.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    finished = bool(len(new)) and int(new[-1]) in eos_ids
    text = chat.tokenizer.decode(new, skip_special_tokens=True).strip()
    return text, ids.shape[1], len(new), "stop" if finished or len(new) < gen.max_new_tokens else "length"


def make_server(chat, name: str, host: str = "127.0.0.1", port: int = 8000, max_new_tokens: int = 256) -> ThreadingHTTPServer:
    """An HTTP server answering the OpenAI chat API with `chat` (a pipeline.tools.chat.ChatModel);
    port 0 picks a free port (server.server_address has it)."""
    lock = threading.Lock()  # one generate() at a time: the model is not re-entrant

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def error(self, status: int, message: str) -> None:
            self.reply(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "relay"}]})
            else:
                self.error(404, f"no route {self.path}; try POST /v1/chat/completions")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                self.error(404, f"no route {self.path}; try POST /v1/chat/completions")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0) or 0)) or b"null")
                messages, settings = completion_request(body, max_new_tokens)
            except (ValueError, RequestError) as err:
                self.error(400, str(err))
                return
            with lock:
                text, n_prompt, n_new, reason = answer(chat, messages, settings)
            self.reply(200, completion_response(name, text, n_prompt, n_new, reason))

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - one short line per request
            sys.stderr.write(f"serve: {self.command} {self.path} {args[1] if len(args) > 1 else ''}\n")

    return ThreadingHTTPServer((host, port), Handler)


def vllm_command(folder: str, host: str, port: int) -> list[str]:
    """vLLM's own OpenAI-compatible server on `folder`."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", host, "--port", str(port)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relay serve", description="Serve a model folder on an OpenAI-compatible API "
                                     "(/v1/chat/completions): vLLM when installed, else transformers.")
    parser.add_argument("model", help="a merged model folder (or 'embedded')")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="auto", choices=("auto", "vllm", "transformers"))
    parser.add_argument("--max-new-tokens", type=int, default=256, help="when a request sets no max_tokens")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    args = parser.parse_args(argv)
    from pipeline.engine.tracking import quiet_console
    from pipeline.modeling.models import resolve_model_path
    from pipeline.modeling.preflight import model_problems
    from pipeline.tools.chat import ChatError, load_chat_model

    problems = model_problems(args.model, "model", need="causal")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    has_vllm = importlib.util.find_spec("vllm") is not None
    if args.backend == "vllm" and not has_vllm:
        print("error: --backend vllm: vLLM is not installed (pip install vllm, CUDA only)", file=sys.stderr)
        return 2
    if args.backend == "vllm" or (args.backend == "auto" and has_vllm):
        return subprocess.call(vllm_command(resolve_model_path(args.model), args.host, args.port))
    quiet_console()
    try:
        chat = load_chat_model(args.model, args.dtype)
    except (ChatError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    server = make_server(chat, args.model, args.host, args.port, args.max_new_tokens)
    print(f"serving {args.model} (transformers) on http://{args.host}:{server.server_address[1]}/v1  (Ctrl-C stops)", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
