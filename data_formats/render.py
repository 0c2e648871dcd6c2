"""Rendering a Conversation into token ids and labels, with loss on assistant turns only.

Two template modes:

`role_markers` (MFTCoder's format, seed section 3.1), with markers from the config. The exact
string, with S/U/A the system/user/assistant markers and EOS the tokenizer's eos token::

    S + system + "\\n"                 (optional system turn, first only)
    U + user                           (no newline: the assistant marker follows directly)
    A + assistant + EOS + "\\n"

i.e. with the default markers
``<s>system\\n{system}\\n<s>human\\n{u1}<s>bot\\n{a1}{EOS}\\n<s>human\\n{u2}<s>bot\\n{a2}{EOS}\\n``.
Trained: every assistant content and its EOS; not the markers, not the "\\n" after EOS (like the
"\\n" after <|im_end|> in chat_template mode). The generation prompt is the history + A.

`chat_template` (the tokenizer's own Jinja). Assistant spans are found by rendering prefixes:
for assistant turn i, P = render(turns[:i], add_generation_prompt=True) and
F = render(turns[:i+1]); F must start with P and with the previous F (the template is prefix-
preserving), and the trained span is F[len(P):] up to and including the first EOS after the
content. Templates that inject a default system turn (SmolLM2) do so in every prefix, so this
holds. A template that is not prefix-preserving is refused by `make_template` at start-up.

Tokenization: the whole rendered string is tokenized once, and each token is labelled by where it
starts (fast tokenizer offsets). So input_ids == tokenizer(full_text) ids by construction, with no
boundary artefacts; a token that straddles a span boundary is trained iff it starts inside an
assistant span (with the supported templates none straddles: markers end in "\\n" and EOS is a
special token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from data_formats.conversation import Conversation, Turn

IGNORE_INDEX = -100
_PROBE = Conversation([Turn("system", "S."), Turn("user", "U1?"), Turn("assistant", "A1."),
                       Turn("user", "U2?"), Turn("assistant", "A2.")])
_PROBE_NO_SYSTEM = Conversation(_PROBE.turns[1:])


@dataclass(frozen=True)
class Template:
    """How conversations become text. Build with `make_template`."""

    mode: str
    """'role_markers' or 'chat_template'."""
    eos: str
    """End-of-turn token string (trained after every assistant turn)."""
    markers: dict = field(default_factory=dict)
    """role_markers mode: the opener of each role's turn."""
    chat_template: Optional[str] = None
    """chat_template mode: the Jinja template used."""
    system_prompt: Optional[str] = None
    """System turn the data adds when a conversation has none (kept for the saved template)."""


def _segments_role_markers(conv: Conversation, template: Template, generation_prompt: bool) -> list[tuple[str, bool]]:
    markers = template.markers
    out: list[tuple[str, bool]] = []
    for turn in conv.turns:
        if turn.role == "system":
            out.append((markers["system"] + turn.content + "\n", False))
        elif turn.role == "user":
            out.append((markers["user"] + turn.content, False))
        else:
            out += [(markers["assistant"], False), (turn.content + template.eos, True), ("\n", False)]
    if generation_prompt:
        out.append((markers["assistant"], False))
    return out


def _apply(tokenizer, template: Template, turns: list[Turn], generation_prompt: bool) -> str:
    messages = [{"role": t.role, "content": t.content} for t in turns]
    return tokenizer.apply_chat_template(messages, chat_template=template.chat_template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _segments_chat_template(conv: Conversation, tokenizer, template: Template) -> list[tuple[str, bool]]:
    """Segments of the tokenizer template's rendering (see the module docstring).

    Raises:
        ValueError: the template is not prefix-preserving for this conversation, or an assistant
            turn does not end with the end-of-turn token.
    """
    out: list[tuple[str, bool]] = []
    done = ""
    for i, turn in enumerate(conv.turns):
        if turn.role != "assistant":
            continue
        prompt = _apply(tokenizer, template, conv.turns[:i], True)
        full = _apply(tokenizer, template, conv.turns[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(f"chat template is not prefix-preserving at turn {i} of {conv.source or 'a conversation'}: "
                             "rendering a prefix of the conversation does not give a prefix of the full rendering")
        body = full[len(prompt):]
        start = body.find(turn.content)
        end = body.find(template.eos, start + len(turn.content) if start >= 0 else 0)
        if end < 0:
            raise ValueError(f"chat template does not end assistant turn {i} with {template.eos!r}")
        end += len(template.eos)
        out += [(prompt[len(done):], False), (body[:end], True), (body[end:], False)]
        done = full
    whole = _apply(tokenizer, template, conv.turns, False)
    if not whole.startswith(done):
        raise ValueError(f"chat template is not prefix-preserving for {conv.source or 'a conversation'}")
    out.append((whole[len(done):], False))
    return out


def render_segments(conv: Conversation, tokenizer, template: Template) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces whose concatenation is the full text.

    Raises:
        ValueError: see `_segments_chat_template`; unknown template mode.
    """
    if template.mode == "role_markers":
        return _segments_role_markers(conv, template, False)
    if template.mode == "chat_template":
        return _segments_chat_template(conv, tokenizer, template)
    raise ValueError(f"unknown template mode {template.mode!r}")


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> tuple[list[int], list[int]]:
    """Tokenize the joined text once; label each token whose first character lies in a trained
    segment with its own id, every other token with -100."""
    text = "".join(s for s, _ in segments)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, pos = [], 0
    for piece, trained in segments:
        if trained:
            spans.append((pos, pos + len(piece)))
        pos += len(piece)
    labels, k = [], 0
    for token, (start, _end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        inside = k < len(spans) and spans[k][0] <= start < spans[k][1]
        labels.append(token if inside else IGNORE_INDEX)
    return list(encoded["input_ids"]), labels


def render(conv: Conversation, tokenizer, template: Template) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a whole conversation: labels are -100 except on every assistant
    turn's content and its end-of-turn token.

    Raises:
        ValueError: the chat template is not prefix-preserving for this conversation.
    """
    return tokenize_segments(render_segments(conv, tokenizer, template), tokenizer)


def render_text(conv: Conversation, tokenizer, template: Template) -> str:
    """The full rendered string (what `render` tokenizes)."""
    return "".join(s for s, _ in render_segments(conv, tokenizer, template))


def render_prompt(conv: Conversation, tokenizer, template: Template) -> list[int]:
    """Token ids of the history plus the assistant opener (the generation prompt), for PPO and chat."""
    if template.mode == "role_markers":
        text = "".join(s for s, _ in _segments_role_markers(conv, template, True))
    else:
        text = _apply(tokenizer, template, conv.turns, True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_template(data_cfg, tokenizer) -> "Template":
    """The Template for a ChatDataConfig, checked on probe conversations.

    Raises:
        ValueError: unknown mode; missing role markers; no eos token; the eos string does not
            tokenize to the single eos id; the tokenizer has no chat template or it is not
            prefix-preserving (so assistant spans cannot be located).
    """
    eos = tokenizer.eos_token
    if not eos:
        raise ValueError("the tokenizer has no eos token; cannot mark the end of assistant turns")
    if tokenizer(eos, add_special_tokens=False)["input_ids"] != [tokenizer.eos_token_id]:
        raise ValueError(f"eos token {eos!r} does not tokenize to its single id {tokenizer.eos_token_id}")
    system_prompt = getattr(data_cfg, "system_prompt", None)
    if data_cfg.template == "role_markers":
        missing = {"system", "user", "assistant"} - set(data_cfg.role_markers)
        if missing:
            raise ValueError(f"role_markers is missing marker(s) for {', '.join(sorted(missing))}")
        return Template("role_markers", eos, markers=dict(data_cfg.role_markers), system_prompt=system_prompt)
    if data_cfg.template != "chat_template":
        raise ValueError(f"template must be 'chat_template' or 'role_markers', got {data_cfg.template!r}")
    if not tokenizer.chat_template:
        raise ValueError("template=chat_template but the tokenizer has no chat template; use role_markers")
    template = Template("chat_template", eos, chat_template=tokenizer.chat_template, system_prompt=system_prompt)
    for probe in (_PROBE, _PROBE_NO_SYSTEM):
        try:
            render_segments(probe, tokenizer, template)
        except ValueError as err:
            raise ValueError(f"the tokenizer's chat template cannot be used for training: {err}; use role_markers") from err
    return template


def _jinja_string(text: str) -> str:
    """A Jinja string literal (JSON escaping is a subset Jinja's lexer decodes)."""
    return json.dumps(text, ensure_ascii=True)


def template_jinja(template: Template, tokenizer) -> Optional[str]:
    """A Jinja chat template that renders exactly what role_markers training saw (to save into the
    merged model), or None in chat_template mode, where the tokenizer's own template applies."""
    if template.mode != "role_markers":
        return None
    m = {k: _jinja_string(v) for k, v in template.markers.items()}
    eos = _jinja_string(template.eos)
    default_system = ""
    if template.system_prompt is not None:
        default_system = ("{%- if messages and messages[0]['role'] != 'system' -%}"
                          f"{{{{ {m['system']} + {_jinja_string(template.system_prompt)} + '\\n' }}}}"
                          "{%- endif -%}")
    return (
        default_system
        + "{%- for message in messages -%}"
        + f"{{%- if message['role'] == 'system' -%}}{{{{ {m['system']} + message['content'] + '\\n' }}}}"
        + f"{{%- elif message['role'] == 'user' -%}}{{{{ {m['user']} + message['content'] }}}}"
        + f"{{%- elif message['role'] == 'assistant' -%}}{{{{ {m['assistant']} + message['content'] + {eos} + '\\n' }}}}"
        + "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
        + "{%- endif -%}{%- endfor -%}"
        + f"{{%- if add_generation_prompt -%}}{{{{ {m['assistant']} }}}}{{%- endif -%}}"
    )
