"""A stub OpenAI-compatible judge on loopback for the LLM-judge tests (tests/test_judge.py, and the
multi-rank runs of tests/test_cells_ddp.py, whose ranks reach it from their own processes): it checks
every request with `relay serve`'s own parser (pipeline/tools/openai_protocol.py), answers with a
chat.completion, and counts requests and how many are in flight at once."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.tools.openai_protocol import ApiError, check_request, completion_response, logprobs_content

SERVED = "stub-judge"


def answer_of(body: dict) -> str:
    return body["messages"][-1]["content"].split("Answer:\n", 1)[-1]


def default_reply(answer: str) -> str:
    """Deterministic: a resumed run and an unbroken one get the same score for the same answer."""
    return str(len(answer) % 11)


def first_token(top: list[tuple[str, float]]) -> list[dict]:
    """The logprobs object of a one-token reply whose top_logprobs are `top` [(token, probability)]."""
    return [logprobs_content([(top[0][0], math.log(top[0][1]), [(t, math.log(p)) for t, p in top])])]


class Stub:
    """A ThreadingHTTPServer answering /v1/chat/completions; `reply(answer)` says what (None: HTTP
    500; (seconds, text): sleep that long first, then answer; a list of (token, probability): a
    one-token reply with those top_logprobs)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.auth: set = set()
        self.in_flight = self.max_in_flight = 0
        self.delay = 0.0
        self.reply = default_reply
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.in_flight += 1
                    self.counted = True
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                    stub.bodies.append(body)
                    stub.auth.add(self.headers.get("Authorization"))
                try:
                    check_request(body, SERVED)  # what `relay serve` would accept
                    time.sleep(stub.delay)
                    text = stub.reply(answer_of(body))
                    if isinstance(text, tuple):  # (seconds, text): a slow judge
                        time.sleep(text[0])
                        text = text[1]
                    logprobs = None
                    if isinstance(text, list):  # hand-written top_logprobs of the first token
                        logprobs, text = first_token(text), text[0][0]
                    if text is None:
                        self._send(500, {"error": {"message": "boom"}})
                    else:
                        response = completion_response("chatcmpl-1", SERVED, [text], ["stop"], 1, 1, logprobs)
                        self._send(200, response)
                except ApiError as err:
                    self._send(err.status, {"error": {"message": str(err)}})
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    self._done()

            def _done(self):
                # before the reply is written: the client may send its next request as soon as it
                # has read this one, and that request must not find this one still counted
                with stub.lock:
                    if getattr(self, "counted", False):
                        stub.in_flight -= 1
                        self.counted = False

            def _send(self, status, payload):
                self._done()
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self):
        self.bodies.clear()
        self.auth.clear()
        self.in_flight = self.max_in_flight = 0
        self.delay, self.reply = 0.0, default_reply


def judge_flags(url: str, ranks: int) -> list[str]:
    """A stage's command-line flags for the stub judge at `url` as one more reward (weight 0.5), the
    requests in flight shared by `ranks` processes, a failed request scoring 0."""
    return [
        "--judge.base_url",
        url,
        "--judge.model",
        SERVED,
        "--judge.max_concurrency",
        str(ranks),
        "--judge.on_failure",
        "0.0",
        "--judge.retry_backoff",
        "0",
        "--judge.weight",
        "0.5",
    ]


@pytest.fixture(scope="module")
def judge_stub():
    """A stub judge for a module's runs (their ranks reach it from their own processes)."""
    stub = Stub()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()
