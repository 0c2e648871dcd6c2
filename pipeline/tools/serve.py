"""Serve a model folder on an OpenAI-compatible HTTP API.

    relay serve outputs/demo/ppo/merged --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "merged", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}'

With `--backend vllm` this runs vLLM's own OpenAI server on the folder (`--backend auto` too when
vLLM is importable here): on a CPU from its own environment, bench/.venv-vllm
(run_scripts/install_vllm.sh; pipeline/modeling/vllm_server.py says why). Otherwise a FastAPI app
on uvicorn answers `GET /v1/models` and `POST /v1/chat/completions` as OpenAI clients use it
(pipeline.tools.openai_protocol: streaming as server-sent events, `n`, `stop`, text-part content,
the developer role, `logprobs`/`top_logprobs` without streaming; OpenAI-style errors), prompting
through the folder's own chat template exactly as `relay chat` does. Requests are batched together
(pipeline.tools.serve_batch): one generate call serves every request waiting, for at most
--slice-tokens new tokens per row; rows still going continue in the next batch beside requests
that arrived meanwhile, so a long answer never holds the others back. Limits: --max-request-bytes per body, the model's
context for prompt + max_tokens, --request-timeout per request (an answer still running then ends with
finish_reason "length"). Any OpenAI client works: `OpenAI(base_url="http://localhost:8000/v1",
api_key="unused")`; the model name is the folder's name (--name changes it).

--api-key KEY (or the environment variable RELAY_API_KEY, which keeps the key out of `ps`): every
route then needs `Authorization: Bearer KEY`, compared in constant time, and answers an
OpenAI-style 401 without it; GET /health stays open (a liveness probe), as in vLLM's server.
With --backend vllm the key guards every route of vLLM's server, not only its /v1 ones
(/invocations, /tokenize, /pooling, ... answer without vLLM's own key): Relay's guard runs inside
vLLM's app and gets the key in its environment, never on its command line
(pipeline/modeling/vllm_side/relay_vllm_guard.py); it also refuses chat messages with a role
Relay's server refuses. The vLLM server stops with this process: on SIGTERM, SIGINT or SIGHUP it
is stopped whole, and this process killed outright still takes it down
(pipeline.modeling.vllm_server.launch).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Sequence

from fastapi import Request  # module level: FastAPI resolves the handlers' (postponed) annotations here

from pipeline.config import ModelConfig
from pipeline.modeling.embedded import resolve_model_path
from pipeline.tools.openai_protocol import (
    ApiError,
    ChatRequest,
    check_request,
    chunk,
    completion_response,
    context_of,
    logprobs_content,
    new_id,
    usage,
)
from pipeline.tools.serve_tools import CallStream, answer_message, prompt_and_prefill
from pipeline.tools.serving import SERVING, serve_choice, serve_values
from pipeline.tools.vllm_serving import serve_vllm

if TYPE_CHECKING:  # the batcher imports torch and the model stack: `--backend vllm` never needs them
    from pipeline.tools.serve_batch import Job

MAX_WAITING = 256
"""Requests queued beyond this are refused with 429 instead of waiting past their time limit."""


def eos_ids_of(chat) -> list[int]:
    """The ids that end an answer: the generation config's EOS ids and the tokenizer's."""
    eos = chat.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) | {chat.tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


def plan_tokens(request: ChatRequest, prompt_len: int, context: int, default: int) -> int:
    """max new tokens for a request (pure): its max_tokens, else `default`, within the context.

    Raises:
        ApiError: the prompt, or prompt + max_tokens, does not fit the context (400).
    """
    if prompt_len >= context:
        raise ApiError(
            400,
            f"the prompt is {prompt_len} tokens; this model's context is {context} tokens",
            "messages",
            "context_length_exceeded",
        )
    if request.max_tokens is None:
        return min(default, context - prompt_len)
    if prompt_len + request.max_tokens > context:
        raise ApiError(
            400,
            f"max_tokens {request.max_tokens} + the prompt's {prompt_len} tokens exceed this model's context of "
            f"{context} tokens (at most {context - prompt_len})",
            "max_tokens",
            "context_length_exceeded",
        )
    return request.max_tokens


async def read_body(request, limit: int) -> Any:
    """The JSON body, refused past `limit` bytes (413) before it is all read.

    Raises:
        ApiError: too large (413), or not JSON (400).
    """
    declared = request.headers.get("content-length")
    too_large = ApiError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
        None,
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise too_large
    try:
        return json.loads(data or b"null")
    except ValueError as err:
        raise ApiError(400, f"the body is not valid JSON: {err}") from err


class Server:
    """The app's state: the model, its batcher and the limits."""

    def __init__(
        self,
        chat,
        name: str,
        max_new_tokens: int = 256,
        max_batch: int = 16,
        window: float = 0.02,
        request_timeout: float = 120.0,
        max_request_bytes: int = 1 << 20,
        slice_tokens: int = 32,
    ):
        from pipeline.tools.chat import prompt_ids
        from pipeline.tools.serve_batch import Batcher

        self.chat, self.name, self.prompt_ids = chat, name, prompt_ids
        self.max_new_tokens, self.request_timeout, self.max_request_bytes = (
            max_new_tokens,
            request_timeout,
            max_request_bytes,
        )
        self.context = context_of(chat.model.config)
        pad = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else eos_ids_of(chat)[0]
        self.batcher = Batcher(chat.model, chat.tokenizer, eos_ids_of(chat), pad, max_batch, window, slice_tokens)

    async def job(self, request: ChatRequest) -> tuple[Job, "asyncio.Queue[tuple]", int, str]:
        """(queued job, its event queue, prompt tokens, the text its answers start with: a forced
        tool call's opener, pipeline/tools/serve_tools.py) for a checked request."""
        from starlette.concurrency import run_in_threadpool

        from pipeline.tools.serve_batch import Job

        if self.batcher.waiting.qsize() >= MAX_WAITING:
            raise ApiError(
                429,
                "the server is busy (too many requests waiting); retry shortly",
                None,
                "rate_limit_exceeded",
                "rate_limit_error",
            )
        prefill = ""
        if request.tools:
            prompt, prefill = await run_in_threadpool(prompt_and_prefill, self.chat.tokenizer, request)
        else:
            prompt = await run_in_threadpool(self.prompt_ids, self.chat.tokenizer, request.messages)
        max_new = plan_tokens(request, len(prompt), self.context, self.max_new_tokens)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(
            prompt=prompt,
            n=request.n,
            max_new_tokens=max_new,
            temperature=request.temperature,
            top_p=request.top_p,
            stops=request.stop,
            deadline=time.monotonic() + self.request_timeout,
            seed=request.seed,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
        )
        self.batcher.submit(job)
        return job, events, len(prompt), prefill

    async def complete(self, request: ChatRequest) -> dict:
        job, events, n_prompt, prefill = await self.job(request)
        texts, reasons = [""] * request.n, [""] * request.n
        try:
            while not all(reasons):
                event = await events.get()
                if event[0] == "error":
                    raise ApiError(event[1], event[2], None, "server_error", "server_error")
                if event[0] == "delta":
                    texts[event[1]] += event[2]
                else:
                    reasons[event[1]] = event[2]
        finally:
            job.cancelled = True  # a client gone mid-answer frees its rows at the next step
        if request.wants_calls:
            texts, reasons = map(list, zip(*(answer_message(prefill + t, r) for t, r in zip(texts, reasons))))
        logprobs = [logprobs_content(steps) for steps in job.steps] if request.logprobs else None
        return completion_response(new_id(), self.name, texts, reasons, n_prompt, job.completion_tokens, logprobs)

    async def stream(self, request: ChatRequest) -> AsyncIterator[str]:
        """The request queued (so its errors are still a status code), then its event stream."""
        job, events, n_prompt, prefill = await self.job(request)
        return self.events(request, job, events, n_prompt, prefill)

    async def events(
        self, request: ChatRequest, job: Job, events: "asyncio.Queue[tuple]", n_prompt: int, prefill: str = ""
    ) -> AsyncIterator[str]:
        """Server-sent events: a role chunk per choice, content deltas, a finish chunk per choice,
        the usage chunk when asked for, then [DONE]. Answers read for tool calls go through a
        CallStream each (tool-call deltas before their finish chunk)."""
        cid, left = new_id(), request.n
        calls = [CallStream(prefill) for _ in range(request.n)] if request.wants_calls else None

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            for i in range(request.n):
                yield sse(chunk(cid, self.name, i, {"role": "assistant", "content": ""}))
            while left:
                event = await events.get()
                if event[0] == "error":
                    yield sse(ApiError(event[1], event[2], None, "server_error", "server_error").body())
                    break
                if event[0] == "delta":
                    text = calls[event[1]].add(event[2]) if calls else event[2]
                    if text:
                        yield sse(chunk(cid, self.name, event[1], {"content": text}))
                else:
                    reason = event[2]
                    if calls:
                        deltas, reason = calls[event[1]].finish(reason)
                        for delta in deltas:
                            yield sse(chunk(cid, self.name, event[1], delta))
                    yield sse(chunk(cid, self.name, event[1], {}, reason))
                    left -= 1
            if request.include_usage:
                yield sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": int(time.time()),
                        "model": self.name,
                        "choices": [],
                        "usage": usage(n_prompt, job.completion_tokens),
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True


API_KEY_ENV = "RELAY_API_KEY"


def key_error(authorization: Optional[str], key: str) -> Optional[ApiError]:
    """The 401 for a request whose Authorization header does not carry `key` (None when it does);
    compared in constant time, so the answer's timing does not reveal how much of a guess was right."""
    if not authorization:
        return ApiError(
            401,
            "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY)",
            None,
            "missing_api_key",
        )
    if not hmac.compare_digest(authorization.encode("utf-8"), f"Bearer {key}".encode("utf-8")):
        return ApiError(401, "Incorrect API key provided", None, "invalid_api_key")
    return None


def require_key(app, key: str) -> None:
    """Refuse every request without the key but GET /health, as vLLM's server does. OPTIONS needs
    it too: vLLM lets it pass for its CORS middleware's preflight answers, and this app has none, so
    an OPTIONS request is one more method a path does not take (405, `make_app`)."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        error = None
        if (request.method, request.url.path) != ("GET", "/health"):
            error = key_error(request.headers.get("authorization"), key)
        if error is not None:
            return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def allowed_methods(app, scope: dict) -> list[str]:
    """The methods some route of `app` takes at the scope's path, sorted (the router's own Allow
    header names one route's, in a set's order)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


def make_app(server: Server, api_key: Optional[str] = None):
    """The FastAPI app over `server` (its batcher runs while the app does); with `api_key`, every
    route but GET /health needs it (`require_key`)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app):
        server.batcher.start()
        yield
        server.batcher.stop()

    app = FastAPI(title="relay serve", lifespan=lifespan)
    if api_key:
        require_key(app, api_key)

    @app.get("/health")
    async def health():
        return {}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        headers = dict(err.headers or {})
        if err.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
            message = f"{request.url.path} does not take {request.method}; it takes {headers['Allow']}"
        elif err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; try POST /v1/chat/completions"
        else:
            message = str(err.detail)
        return JSONResponse(ApiError(err.status_code, message).body(), status_code=err.status_code, headers=headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "relay"}]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{server.name}'",
                "model",
                "model_not_found",
            )
        return {"id": server.name, "object": "model", "created": 0, "owned_by": "relay"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        checked = check_request(await read_body(request, server.max_request_bytes), server.name)
        if checked.stream:
            return StreamingResponse(await server.stream(checked), media_type="text/event-stream")
        return await server.complete(checked)

    return app


def run(app, host: str, port: int, sock=None) -> None:
    """Serve `app` with uvicorn until Ctrl-C (on `sock` when given: tests bind 127.0.0.1:0)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relay serve",
        description="Serve a model folder on an OpenAI-compatible API "
        "(/v1/chat/completions): vLLM (--backend vllm, or when importable), else Relay's own engine "
        "(--backend relay: FastAPI + transformers).",
    )
    parser.add_argument("model", help="a merged model folder (or 'embedded')")
    parser.add_argument("--name", help="the model name clients use (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", default="auto", choices=serve_values())
    parser.add_argument("--max-new-tokens", type=int, default=256, help="when a request sets no max_tokens")
    parser.add_argument("--max-batch", type=int, default=16, help="most rows (requests x n) in one generation batch")
    parser.add_argument(
        "--batch-window", type=float, default=0.02, help="seconds the batcher waits for more requests after the first"
    )
    parser.add_argument(
        "--slice-tokens",
        type=int,
        default=32,
        help="new tokens per row per batch; unfinished rows continue beside newly arrived requests",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds a request may take, waiting included"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="largest request body accepted (413 beyond)"
    )
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every route but GET /health "
        f"(default: ${API_KEY_ENV}, which keeps it out of ps)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="vLLM: longest prompt + answer (sizes its KV cache)"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="vLLM: no torch.compile (--enforce-eager): on a CPU it starts much sooner and decodes "
        "somewhat slower (bench/RESULTS.md)",
    )
    args = parser.parse_args(argv)
    problems = model_folder_problems(args.model)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    chosen = serve_choice(args.backend)
    for owner in SERVING.values():
        for option in owner.serve_options:
            if getattr(args, option) and option not in SERVING[chosen].serve_options:
                print(f"error: --{option} is a {owner.label} option (--backend {owner.serve_name})", file=sys.stderr)
                return 2
    return SERVERS[chosen](args)


def model_folder_problems(path: str) -> list[str]:
    """What keeps `path` from being served, one line each: pipeline.modeling.preflight's checks for a
    causal LM, then a folder that loads only with the code it ships (remote_code_problems), which
    neither backend of relay serve runs."""
    from pipeline.modeling import models, preflight

    advice = "relay serve runs no code from a model folder (`relay chat --trust-remote-code` runs it, trusted)"
    return preflight.model_problems(path, "model", need="causal") or models.remote_code_problems(
        ModelConfig(path=path), "model", opt_in=advice
    )


def serve_on_vllm(args: argparse.Namespace) -> int:
    """`relay serve` on vLLM's own server (`serve_vllm`)."""
    folder = resolve_model_path(args.model)
    return serve_vllm(
        folder,
        args.name or Path(folder).name,
        args.host,
        args.port,
        args.max_batch,
        args.dtype,
        args.max_model_len,
        args.api_key,
        args.eager,
    )


def serve_on_relay(args: argparse.Namespace) -> int:
    """`relay serve` on Relay's FastAPI app over the folder loaded with transformers (`Server`)."""
    from pipeline.engine.tracking import quiet_console
    from pipeline.tools.chat import ChatError, load_chat_model

    quiet_console()
    try:
        chat = load_chat_model(args.model, args.dtype)
    except (ChatError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = args.name or Path(resolve_model_path(args.model)).name
    server = Server(
        chat,
        name,
        args.max_new_tokens,
        args.max_batch,
        args.batch_window,
        request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        slice_tokens=args.slice_tokens,
    )
    guard = "API key required" if args.api_key else "no API key: anyone who reaches the port can use it"
    print(
        f"serving {args.model} as '{name}' (transformers) "
        f"on http://{args.host}:{args.port}/v1, {guard}  (Ctrl-C stops)",
        file=sys.stderr,
    )
    run(make_app(server, args.api_key), args.host, args.port)
    return 0


SERVERS = {"relay": serve_on_relay, "vllm": serve_on_vllm}
"""Serving backend (pipeline/tools/serving.py) -> serve(parsed arguments) -> exit status."""

if __name__ == "__main__":
    raise SystemExit(main())
