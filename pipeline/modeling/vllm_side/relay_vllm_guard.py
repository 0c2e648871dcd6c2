"""Relay's guard inside vLLM's OpenAI server: the API key on every route, and Relay's role check
on chat requests.

vLLM's own key (--api-key, VLLM_API_KEY) covers paths under /v1 only: /invocations, /tokenize,
/detokenize, /pooling, /score, /metrics, the development routes (/collective_rpc, /sleep, ...)
answer anyone who reaches the port. This ASGI middleware, which pipeline/modeling/vllm_server.py
starts vLLM with (`--middleware relay_vllm_guard.Guard`), sits outside all of vLLM's app, so a
request without `Authorization: Bearer KEY` is refused before any route, mounted app or websocket
sees it, whatever routes this vLLM version has. Open without the key: GET /health (a liveness
probe, as on Relay's own server) and OPTIONS (CORS preflight, which browsers send without
credentials; vLLM's middleware lets it pass too).

Requests with chat messages get the role check of Relay's own server
(pipeline/tools/openai_protocol.py, `check_messages`): vLLM renders a message with an unknown role
(`wizard`) into the prompt and answers it (/v1/chat/completions, its /batch, /invocations,
/tokenize, the pooling routes), Relay's server refuses it with a 400. Every POST whose JSON body
has `messages` (a list of messages, or of lists of them) is checked, whatever its route. The roles
come from Relay (RELAY_VLLM_ROLES); the message is the one Relay's server writes.

It runs in vLLM's environment, where nothing of Relay's is importable (this folder alone is on
the server's PYTHONPATH): the standard library only. The key comes from RELAY_VLLM_KEY in the
server's environment (never its command line, which `ps` shows) and is removed from it once read.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, Awaitable, Callable, Optional, Sequence

KEY_ENV = "RELAY_VLLM_KEY"
ROLES_ENV = "RELAY_VLLM_ROLES"
OPEN = frozenset({("GET", "/health")})
"""(method, path) answered without the key."""

_KEY = os.environ.pop(KEY_ENV, None) or None
_ROLES = tuple(json.loads(os.environ.get(ROLES_ENV) or "[]"))


def error_body(message: str, param: Optional[str], code: str) -> bytes:
    """An OpenAI-style error object (Relay's `ApiError.body`)."""
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    ).encode()


def role_error(body: Any, roles: Sequence[str]) -> Optional[bytes]:
    """The 400 body for a request whose `messages` hold one with a role not in `roles` (Relay's
    `check_messages` message; the batch route's conversations are indexed the same way, one level
    deeper); None when every role is known or the body has no list of messages (vLLM answers
    those itself)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None
    batch = bool(messages) and all(isinstance(m, list) for m in messages)
    for prefix, conversation in (
        [(f"messages[{j}]", c) for j, c in enumerate(messages)] if batch else [("messages", messages)]
    ):
        for i, m in enumerate(conversation):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in roles:
                return error_body(
                    f"{prefix}[{i}].role must be one of {', '.join(roles)} (got {role!r})",
                    f"{prefix}[{i}].role",
                    "invalid_value",
                )
    return None


class Guard:
    """Pure ASGI middleware (streaming answers pass through untouched)."""

    def __init__(
        self, app: Callable[..., Awaitable[None]], key: Optional[str] = None, roles: Optional[Sequence[str]] = None
    ):
        self.app = app
        key = key if key is not None else _KEY
        self.expected = f"Bearer {key}".encode() if key else None
        self.roles = tuple(roles) if roles is not None else _ROLES

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method = scope.get("method", "GET")
        path = scope["path"].removeprefix(scope.get("root_path", "") or "") or "/"
        if self.expected is not None and method != "OPTIONS" and (method, path) not in OPEN:
            given = dict(scope.get("headers") or []).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                return await self.refuse(scope, send, given is None)
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
        if scope["type"] == "http" and method == "POST" and self.roles and not content_type.startswith(b"multipart/"):
            return await self.check_messages(scope, receive, send)
        return await self.app(scope, receive, send)

    async def refuse(self, scope: dict, send: Callable, missing: bool) -> None:
        if scope["type"] == "websocket":  # closed before the handshake: the client gets HTTP 403
            return await send({"type": "websocket.close", "code": 1008})
        if missing:
            body = error_body(
                "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY)",
                None,
                "missing_api_key",
            )
        else:
            body = error_body("Incorrect API key provided", None, "invalid_api_key")
        await respond(send, 401, body, [(b"www-authenticate", b"Bearer")])

    async def check_messages(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Read the whole body, refuse an unknown role, else hand the same body on to vLLM."""
        parts, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        data = b"".join(parts)
        try:
            refused = role_error(json.loads(data), self.roles)
        except (ValueError, RecursionError):  # not JSON: vLLM says so in its own words
            refused = None
        if refused is not None:
            return await respond(send, 400, refused)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the client's disconnect, for a streaming answer
            replayed = True
            return {"type": "http.request", "body": data, "more_body": False}

        return await self.app(scope, replay, send)


async def respond(send: Callable, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
