"""Run by tests/test_vllm.py with vLLM's own interpreter: vLLM's `hermes` tool-call parser (what
`relay serve --backend vllm` starts vLLM with) reads a generated assistant text, whole and as
streamed token by token. Prints JSON: the whole read (content, [name, arguments text] per call),
the streamed read (content, and per call index its name and concatenated argument deltas), and
the ids "<tool_call>" tokenizes to.

    python hermes_read.py MODEL_FOLDER TEXT
"""

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


def main() -> None:
    folder, text = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(folder)
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "u"}],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}],
    )
    whole = Hermes2ProToolParser(tok).extract_tool_calls(text, request)
    parser, ids = Hermes2ProToolParser(tok), tok(text, add_special_tokens=False)["input_ids"]
    content, calls, sent, previous = "", {}, 0, ""
    for k in range(1, len(ids) + 1):
        current = tok.decode(ids[:k])
        if current.endswith("\ufffd") and k < len(ids):  # a character split across tokens waits for its rest
            continue
        delta = parser.extract_tool_calls_streaming(
            previous, current, current[len(previous) :], ids[:sent], ids[:k], ids[sent:k], request
        )
        previous, sent = current, k
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(str(call.index), {"name": None, "arguments": ""})
            function = call.function if isinstance(call.function, dict) else call.function.model_dump(exclude_none=True)
            entry["name"] = function.get("name") or entry["name"]
            entry["arguments"] += function.get("arguments") or ""
    print(
        json.dumps(
            {
                "whole": {
                    "called": whole.tools_called,
                    "content": whole.content,
                    "calls": [[c.function.name, c.function.arguments] for c in whole.tool_calls],
                },
                "streamed": {"content": content, "calls": calls},
                "opener_ids": tok("<tool_call>", add_special_tokens=False)["input_ids"],
            }
        )
    )


if __name__ == "__main__":
    main()
