"""Chat with any stage's merged model, using the chat template it was trained with.

    python -m pipeline.tools.chat --model outputs/demo/ppo/merged                    # interactive, streamed
    python -m pipeline.tools.chat --model embedded --prompt "What is the capital of France?"
    python -m pipeline.tools.chat --model embedded --compare outputs/demo/ppo/merged --prompt "..."

The prompt is rendered by the folder's own chat template (for an SFT run in role_markers mode that
is the Jinja the stage saved into merged/), so the model sees the format it was trained on.
Decoding is greedy unless --temperature > 0. In interactive mode, /reset clears the history,
/help lists the commands, and /exit, exit, quit (or Ctrl-D) quit; no line starting with '/' is sent
to the model. The folder is checked first (pipeline.modeling.preflight): a reward model, a LoRA
adapter or a missing folder is one line, not a traceback. With `--tools module:function ...` (run
them) or `--tool-schemas FILE` (you type each result) the model may call tools: its calls and the
results are shown (pipeline/tools/chat_tools.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from data_formats.tools import template_tools
from pipeline.config import ModelConfig
from pipeline.engine.tracking import quiet_console
from pipeline.modeling import decode, vllm_server
from pipeline.modeling import models as modeling
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.preflight import model_problems
from pipeline.tools.chat_tools import answer_with_tools, tool_setup
from pipeline.tools.openai_protocol import context_of
from pipeline.tools.serve_batch import ChoiceText
from pipeline.tools.serve_tools import tool_support_problem
from pipeline.tools.serving import SERVING


class ChatError(RuntimeError):
    """The model folder cannot be chatted with (e.g. its tokenizer has no chat template)."""


class ContextFull(ChatError):
    """The conversation and the answer's token budget do not fit the model's context (said in one
    line; the turn is taken back, /reset starts a new conversation)."""


EXIT_WORDS = ("/exit", "/quit", "exit", "quit")
HELP = "commands: /reset clears the history, /help shows this, /exit (or exit, quit, Ctrl-D) quits"


@dataclass
class Generation:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0

    def kwargs(self) -> dict:
        """generate() arguments: greedy at temperature 0, sampling otherwise."""
        out = {"max_new_tokens": self.max_new_tokens, "repetition_penalty": self.repetition_penalty}
        if self.temperature > 0:
            out.update(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None)
        else:
            out.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return out


@dataclass
class ChatModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    last_answer_cut: bool = False
    """True when the latest reply() stopped at --max-new-tokens rather than at an end-of-turn token."""
    server: Optional[object] = None
    """`--backend vllm`: the vLLM server (pipeline/modeling/vllm_server.py) that answers in place of
    `model` (then None)."""
    eos_ids: Optional[list[int]] = None
    """With `server`: the end-of-turn ids (`chat_eos_ids`)."""
    context: int = 2048
    """Tokens the model reads at most (its config's max_position_embeddings)."""


def was_cut(new_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]) -> bool:
    """True when an answer of `new_ids` ended at the token limit, not at an EOS id (pure)."""
    return len(new_ids) >= max_new_tokens and (not new_ids or int(new_ids[-1]) not in set(eos_ids))


def cut_marker(chat: ChatModel, gen: "Generation") -> str:
    """What `relay chat` prints after an answer that stopped at the token limit ('' otherwise)."""
    return (
        f"[answer cut at {gen.max_new_tokens} tokens: --max-new-tokens raises the limit]"
        if chat.last_answer_cut
        else ""
    )


def load_chat_tokenizer(path: str, *, trust_remote_code: bool = False, allow_pickle: bool = False):
    """The tokenizer of a merged folder (or 'embedded') after the folder's checks, without its weights.

    Raises:
        ChatError: the folder is no causal LM (preflight: missing, an adapter, a reward model, no
            weights or tokenizer) or its tokenizer has no chat template.
    """
    found = model_problems(path, "--model", need="causal", allow_pickle=allow_pickle)
    asked = ModelConfig(path=path, trust_remote_code=trust_remote_code)
    found = found or modeling.remote_code_problems(asked, "--model", "pass --trust-remote-code if you trust the folder")
    if found:
        raise ChatError("; ".join(found))
    folder = resolve_model_path(path)
    tokenizer = modeling.load_tokenizer(folder, trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"{folder}: the tokenizer has no chat template, so there is no chat format to prompt it with")
    return tokenizer


def load_chat_model(
    path: str, dtype: str = "fp32", *, trust_remote_code: bool = False, allow_pickle: bool = False
) -> ChatModel:
    """A merged folder (or 'embedded') ready for generation, through pipeline.modeling.models' loader
    (the folder's own code runs only with `trust_remote_code`, pickled weights load only with
    `allow_pickle`, as in the stages).

    Raises:
        ChatError: see `load_chat_tokenizer`.
        OSError: transformers could not load what preflight let through (its error names it).
    """
    tokenizer = load_chat_tokenizer(path, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    cfg = ModelConfig(
        path=resolve_model_path(path),
        finetuning="full",
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
    )
    model = modeling.load_model(cfg, None, kind="causal", tokenizer=tokenizer)
    model.eval()
    model.requires_grad_(False)
    return ChatModel(name=path, model=model, tokenizer=tokenizer, context=context_of(model.config))


def start_vllm_chat_model(path: str, dtype: str = "fp32", *, trust_remote_code: bool = False) -> ChatModel:
    """`--backend vllm`: the folder's checks and tokenizer here, its weights in a vLLM server started
    on it (fp32 on a CPU for dtype fp32; the caller stops `server`).

    Raises:
        ChatError: see `load_chat_tokenizer`; vLLM absent or its server failed to start.
    """
    if trust_remote_code:
        raise ChatError("--backend vllm: --trust-remote-code is not passed on to vLLM")
    tokenizer = load_chat_tokenizer(path)
    folder = resolve_model_path(path)
    try:
        options = vllm_server.ServerOptions(name="chat", max_num_seqs=2, dtype="float32" if dtype == "fp32" else "auto")
        server = vllm_server.VLLMServer(folder, options).start()
    except vllm_server.VLLMError as err:
        raise ChatError(str(err)) from None
    from transformers import AutoConfig

    return ChatModel(
        name=path,
        model=None,
        tokenizer=tokenizer,
        server=server,
        eos_ids=chat_eos_ids(folder, tokenizer),
        context=context_of(AutoConfig.from_pretrained(folder)),
    )


def open_vllm_chat_model(
    path: str, dtype: str = "fp32", *, trust_remote_code: bool = False, allow_pickle: bool = False
) -> ChatModel:
    """`start_vllm_chat_model` under `load_chat_model`'s call (`allow_pickle` is the in-process loader's
    consent; vLLM reads the folder itself)."""
    return start_vllm_chat_model(path, dtype, trust_remote_code=trust_remote_code)


CHAT_MODELS: dict[str, Callable[..., ChatModel]] = {"relay": load_chat_model, "vllm": open_vllm_chat_model}
"""Serving backend (pipeline/tools/serving.py) -> open(path, dtype, *, trust_remote_code, allow_pickle),
a ChatModel whose `server`, if any, the caller stops."""
SAMPLING_FLAGS = ("top-k", "repetition-penalty")
"""The `relay chat` sampling flags a serving backend may lack (`ServingBackend.sampling`)."""


def unsupported_sampling(backend: str, gen: Generation) -> Optional[str]:
    """Why `backend` cannot sample as `gen` asks (a flag it does not honour is set), or None."""
    entry = SERVING[backend]
    set_flags = {"top-k": bool(gen.top_k), "repetition-penalty": gen.repetition_penalty != 1.0}
    lacking = [flag for flag in SAMPLING_FLAGS if flag not in entry.sampling]
    if not any(set_flags[flag] for flag in lacking):
        return None
    return (
        f"--backend {backend} samples with {' and '.join(entry.sampling)} only: "
        f"drop {'/'.join('--' + flag for flag in lacking)}"
    )


def prompt_ids(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
    """Token ids of the conversation so far plus the assistant opener (the generation prompt);
    `tools`: the tool schemas (function objects) the template shows."""
    extra = {"tools": template_tools(tools)} if tools else {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    # The template already writes any BOS it wants; adding special tokens again would double it.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids_of(model: torch.nn.Module, tokenizer) -> list[int]:
    """The tokenizer's eos id, then any other the model's generation_config names."""
    eos = [tokenizer.eos_token_id]
    extra = getattr(model.generation_config, "eos_token_id", None)
    return eos + [e for e in (extra if isinstance(extra, list) else [extra]) if e is not None and e not in eos]


def chat_eos_ids(folder: str, tokenizer) -> list[int]:
    """`eos_ids_of` without loading the weights: the generation_config transformers would give the
    model (the folder's generation_config.json, else the one its config.json implies)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(folder)
    except OSError:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    return eos_ids_of(SimpleNamespace(generation_config=config), tokenizer)


class StreamPrinter:
    """Prints a reply as its tokens arrive (an `on_token` for pipeline.modeling.decode.generate),
    through the server's incremental text (serve_batch.ChoiceText: a character split across tokens
    waits for its rest); a newline at the end."""

    def __init__(self, tokenizer):
        self.text = ChoiceText(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), [])

    def __call__(self, row: int, token: int) -> bool:
        print(self.text.add(token)[0], end="", flush=True)
        return False

    def close(self) -> None:
        print(self.text.flush(), flush=True)


def reply(
    chat: ChatModel, messages: list[dict], gen: Generation, stream: bool = False, tools: Optional[list[dict]] = None
) -> str:
    """The model's next assistant turn (printed token by token when `stream`), from Relay's decode
    engine; with top_k or a repetition penalty (knobs the engine does not have) from transformers'
    generate. `tools`: the tool schemas in the prompt.

    Raises:
        ContextFull: the prompt and --max-new-tokens pass the model's context (as the server refuses it).
    """
    ids = prompt_ids(chat.tokenizer, messages, tools)
    if len(ids) + gen.max_new_tokens > chat.context:
        raise ContextFull(
            f"[the conversation is {len(ids)} tokens; with --max-new-tokens {gen.max_new_tokens} it passes "
            f"{chat.name}'s context of {chat.context} tokens: /reset starts a new one]"
        )
    if chat.server is not None:
        return vllm_reply(chat, ids, gen, stream)
    if gen.top_k or gen.repetition_penalty != 1.0:
        return hf_reply(chat, ids, gen, stream)
    eos = eos_ids_of(chat.model, chat.tokenizer)
    printer = StreamPrinter(chat.tokenizer) if stream else None
    out = decode.generate(
        chat.model,
        [ids],
        max_new_tokens=gen.max_new_tokens,
        eos_ids=eos,
        pad_id=chat.tokenizer.pad_token_id,
        temperature=gen.temperature,
        top_p=gen.top_p if gen.temperature > 0 else 1.0,
        on_token=printer,
    )
    if printer is not None:
        printer.close()
    chat.last_answer_cut = was_cut(out.tokens[0], gen.max_new_tokens, eos)
    tokens = out.tokens[0][:-1] if out.finished[0] else out.tokens[0]
    return chat.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def vllm_reply(chat: ChatModel, ids: list[int], gen: Generation, stream: bool) -> str:
    """`reply` from the vLLM server (`--backend vllm`): greedy at temperature 0, else sampled with a
    seed drawn from torch's RNG (so --seed repeats a session); printed whole when `stream`."""
    seed = int(torch.randint(0, 2**31 - 1, ())) if gen.temperature > 0 else None
    (tokens,) = vllm_server.completion_ids(
        chat.server,
        [ids],
        gen.max_new_tokens,
        chat.eos_ids,
        temperature=gen.temperature,
        top_p=gen.top_p if gen.temperature > 0 else 1.0,
        seed=seed,
    )
    chat.last_answer_cut = len(tokens) >= gen.max_new_tokens
    text = chat.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    if stream:
        print(text, flush=True)
    return text


def hf_reply(chat: ChatModel, ids: list[int], gen: Generation, stream: bool) -> str:
    """`reply` through transformers' generate (top_k, repetition penalty)."""
    from transformers import TextStreamer

    prompt = torch.tensor([ids])
    streamer = TextStreamer(chat.tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        out = chat.model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=chat.tokenizer.pad_token_id,
            streamer=streamer,
            **gen.kwargs(),
        )
    chat.last_answer_cut = was_cut(
        out[0, prompt.shape[1] :].tolist(), gen.max_new_tokens, eos_ids_of(chat.model, chat.tokenizer)
    )
    return chat.tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()


def side_by_side(left_title: str, left: str, right_title: str, right: str, width: int = 100) -> str:
    """Two texts in two wrapped columns under their titles (pure)."""
    col = max(20, (width - 3) // 2)

    def wrap(text: str) -> list[str]:
        return [line for para in text.splitlines() or [""] for line in (textwrap.wrap(para, col) or [""])]

    a, b = (
        [left_title[:col], "-" * min(col, len(left_title))] + wrap(left),
        [right_title[:col], "-" * min(col, len(right_title))] + wrap(right),
    )
    rows = max(len(a), len(b))
    a, b = a + [""] * (rows - len(a)), b + [""] * (rows - len(b))
    return "\n".join(f"{x:<{col}} | {y}".rstrip() for x, y in zip(a, b))


def start_messages(system: Optional[str]) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def tool_reply(chat: ChatModel, history: list[dict], gen: Generation, setup, read: Callable[[str], str] = input) -> str:
    """The model's answer to the last user turn, with its tool calls shown and answered (chat_tools)."""
    answer = answer_with_tools(
        lambda messages: reply(chat, messages, gen, tools=setup.schemas),
        history,
        setup.tools,
        setup.timeout,
        read,
        cut=lambda: cut_marker(chat, gen),
    )
    print(f"bot> {answer}")
    if chat.last_answer_cut:
        print(cut_marker(chat, gen))
    return answer


def one_shot(models: list[ChatModel], prompt: str, gen: Generation, system: Optional[str] = None, tools=None) -> str:
    """Answer one prompt with one model (streamed) or two (side by side); return what was printed.
    `tools` (chat_tools.ToolSetup, one model): its calls are shown and answered."""
    messages = start_messages(system) + [{"role": "user", "content": prompt}]
    if tools is not None:
        return tool_reply(models[0], messages, gen, tools)
    if len(models) == 1:
        answer = reply(models[0], messages, gen, stream=True)
        if models[0].last_answer_cut:
            print(cut_marker(models[0], gen))
        return answer
    answers = [reply(m, messages, gen) for m in models]
    text = side_by_side(
        models[0].name, answers[0], models[1].name, answers[1], shutil.get_terminal_size((100, 20)).columns
    )
    print(text)
    return text


def interactive(
    models: list[ChatModel],
    gen: Generation,
    system: Optional[str] = None,
    read: Callable[[str], str] = input,
    tools=None,
) -> list[list[dict]]:
    """Multi-turn chat until /exit or end of input; each model keeps its own history. Returns them.
    `tools` (chat_tools.ToolSetup, one model): its calls are shown and answered."""
    histories = [start_messages(system) for _ in models]
    print("Chatting with " + " and ".join(m.name for m in models) + ". " + HELP[len("commands: ") :] + ".")
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            print()
            return histories
        if line.lower() in EXIT_WORDS:
            return histories
        if line == "/reset":
            histories = [start_messages(system) for _ in models]
            continue
        if line.startswith("/"):  # a command, never a prompt: /help and typos alike
            print(HELP if line == "/help" else f"unknown command {line.split()[0]!r}; {HELP}")
            continue
        if not line:
            continue
        lengths = [len(history) for history in histories]
        try:
            answer_turn(models, histories, line, gen, tools, read)
        except ContextFull as err:  # the turn is taken back: the conversation stays as it was
            for history, length in zip(histories, lengths):
                del history[length:]
            print(err)


def answer_turn(models: list[ChatModel], histories: list[list[dict]], line: str, gen: Generation, tools, read) -> None:
    """One user turn of `interactive`: every model's answer printed and appended to its history.

    Raises:
        ContextFull: see `reply`.
    """
    for history in histories:
        history.append({"role": "user", "content": line})
    if tools is not None:  # tool_reply appends the answer's turns itself
        tool_reply(models[0], histories[0], gen, tools, read)
        return
    if len(models) == 1:
        print("bot> ", end="", flush=True)
        answers = [reply(models[0], histories[0], gen, stream=True)]
        if models[0].last_answer_cut:
            print(cut_marker(models[0], gen))
    else:
        answers = [reply(m, h, gen) for m, h in zip(models, histories)]
        print(
            side_by_side(
                models[0].name, answers[0], models[1].name, answers[1], shutil.get_terminal_size((100, 20)).columns
            )
        )
    for history, answer in zip(histories, answers):
        history.append({"role": "assistant", "content": answer})


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="relay chat", description="Chat with a merged model (any stage) or 'embedded'."
    )
    parser.add_argument("--model", required=True, help="merged model folder, or 'embedded'")
    parser.add_argument("--compare", help="a second model; answers are shown side by side")
    parser.add_argument("--prompt", help="answer this one prompt and exit (default: interactive)")
    parser.add_argument("--system", help="system turn to start the conversation with")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--dtype", default="fp32", choices=("auto", "fp32", "bf16", "fp16"))
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling")
    parser.add_argument(
        "--tools", nargs="+", metavar="MODULE:FUNCTION", help="tools the model may call; Relay runs them"
    )
    parser.add_argument(
        "--tool-schemas",
        metavar="FILE",
        help="JSON list of tool schemas: with --tools, "
        "for tools whose docstring gives none; alone, you type each result",
    )
    parser.add_argument("--tool-timeout", type=float, default=10.0, help="seconds one tool call may run")
    parser.add_argument(
        "--backend",
        default="relay",
        choices=tuple(CHAT_MODELS),
        help="who answers: relay (its decode engine, or transformers for --top-k/--repetition-penalty) "
        "or vllm (a vLLM server started on each model: run_scripts/install_vllm.sh)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run code shipped in the model folder (auto_map)"
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="load pickled weights (pytorch_model.bin) when the folder has no safetensors (weights_only=True)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    quiet_console()
    torch.manual_seed(args.seed)
    gen = Generation(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty)
    models: list[ChatModel] = []
    try:
        if (args.tools or args.tool_schemas) and args.compare:
            raise ValueError("--tools/--tool-schemas chat with one model: drop --compare")
        tools = tool_setup(args.tools, args.tool_schemas, args.tool_timeout)
        refused = unsupported_sampling(args.backend, gen)
        if refused:
            raise ValueError(refused)
        for path in [args.model] + ([args.compare] if args.compare else []):
            models.append(
                CHAT_MODELS[args.backend](
                    path, args.dtype, trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle
                )
            )
        if tools is not None:
            problem = tool_support_problem(models[0].tokenizer)
            if problem:
                raise ChatError(f"--tools: {problem}")
    except (ChatError, OSError, ValueError) as err:
        stop_servers(models)
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        if args.prompt is not None:
            one_shot(models, args.prompt, gen, args.system, tools)
        else:
            interactive(models, gen, args.system, tools=tools)
    except ContextFull as err:
        print(f"error: {str(err).strip('[]')}", file=sys.stderr)
        return 2
    finally:
        stop_servers(models)
    return 0


def stop_servers(models: list[ChatModel]) -> None:
    for chat in models:
        if chat.server is not None:
            chat.server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
