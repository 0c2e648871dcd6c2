"""Rendering a Conversation into token ids and labels, with loss on assistant turns only.

Two template modes:

`role_markers` (MFTCoder's chatML, seed section 3.1), with markers from the config and one of two
layouts (`data.role_layout`). With S/U/A the system/user/assistant markers and EOS the tokenizer's
eos token:

    readme (default)             code
    S + system + "\\n"           S + system + "\\n"
    U + user                     U + user + "\\n"
    A + [assistant + EOS] + "\\n"  A + [assistant + "\\n" + EOS] + "\\n"

Brackets mark what is trained. `readme` is the string in MFTCoder's README (the seed document,
so Relay's default): ``<s>human\\n{u}<s>bot\\n{a}{EOS}\\n``. `code` is what MFTCoder's code
writes (preprocess_data.py `content_format`, chat_template.py and its inference script): every
content followed by "\\n", and the "\\n" before EOS inside the loss, ``<s>human\\n{u}\\n<s>bot\\n
{a}\\n{EOS}\\n``: pick it to continue a CodeFuse model byte for byte. Neither trains the markers
or the "\\n" after EOS (like the "\\n" after <|im_end|> in chat_template mode). The generation
prompt is the history + A.

`chat_template` (the tokenizer's own Jinja). Assistant spans are found by rendering prefixes:
for assistant turn i, P = render(turns[:i], add_generation_prompt=True) and
F = render(turns[:i+1]); F must start with P and with the previous F (the template is prefix-
preserving), and the trained span is F[len(P):] up to and including the first EOS after the
content. Templates that inject a default system turn (SmolLM2) do so in every prefix, so this
holds. A template that is not prefix-preserving is refused by `make_template` at start-up.

Tokenization (MFTCoder's rule: prompt part and answer part tokenized separately, ids
concatenated): every trained span (an answer and its end-of-turn) is tokenized on its own, and
so is every run of untrained text between two spans. A token can therefore never straddle the
prompt/answer boundary: an answer that starts with spaces ("    return a + b") is trained as the
model must produce it after a prompt that ends in a lone "\\n", which is how the generation prompt
ends at inference. `render_prompt` tokenizes the same way, so the ids before each assistant span
are exactly the generation prompt for that turn (tested). Where the text is not split at a
boundary (no leading whitespace), the ids equal the one-shot tokenization of the whole string.

Tool-calling conversations (data_formats.tools): in chat_template mode, with a tokenizer template
that renders tools and calls (`Template.tools` 'native'), the messages and `tools` go to the
template as they are and the spans are found as above (tool results are not assistant turns, so
they stay in the untrained prompt); otherwise, and always in role_markers mode ('layout'), the
conversation is first rewritten into Relay's default tool layout (plain turns: calls are assistant
text, results a user turn, the schemas in the system turn) and rendered as any other. Either way
the assistant's calls and answers are trained with their end-of-turn token, and nothing else.
An assistant turn with `trained` False (OpenAI's `weight` 0) is rendered the same, untrained.

Scored sequences (the reward model's and PPO's): a conversation scored by a reward model ends at
the end-of-turn token that closes its last answer (`render_scored`: the prompt ids, then the
answer ids ending with EOS; nothing after). The reward is read at that token
(`pipeline.modeling.scoring.reward_readout_index`), in RM training, RM evaluation, the reward statistics
and PPO, where a response is cut at its first EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from data_formats.conversation import Conversation, Turn
from data_formats.tools import (
    jinja_string,
    layout_jinja,
    layout_turns,
    supports_tools,
    template_messages,
    template_tools,
)

IGNORE_INDEX = -100
_PROBE = Conversation(
    [Turn("system", "S."), Turn("user", "U1?"), Turn("assistant", "A1."), Turn("user", "U2?"), Turn("assistant", "A2.")]
)
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
    layout: str = "readme"
    """role_markers mode: 'readme' or 'code' (see the module docstring)."""
    tools: str = "layout"
    """How tool conversations render: 'native' (the tokenizer's template renders tools and calls)
    or 'layout' (Relay's default tool layout, data_formats.tools)."""


ROLE_LAYOUTS = ("readme", "code")


def _segments_role_markers(conv: Conversation, template: Template, generation_prompt: bool) -> list[tuple[str, bool]]:
    markers = template.markers
    after = "\n" if template.layout == "code" else ""
    out: list[tuple[str, bool]] = []
    for turn in conv.turns:
        if turn.role == "system":
            out.append((markers["system"] + turn.content + "\n", False))
        elif turn.role == "user":
            out.append((markers["user"] + turn.content + after, False))
        else:
            out += [(markers["assistant"], False), (turn.content + after + template.eos, turn.trained), ("\n", False)]
    if generation_prompt:
        out.append((markers["assistant"], False))
    return out


def _apply(tokenizer, template: Template, conv: Conversation, turns: list[Turn], generation_prompt: bool) -> str:
    kwargs = {"tools": template_tools(conv.tools)} if conv.tools else {}
    return tokenizer.apply_chat_template(
        template_messages(turns),
        chat_template=template.chat_template,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **kwargs,
    )


def _segments_chat_template(
    conv: Conversation, tokenizer, template: Template, generation_prompt: bool
) -> list[tuple[str, bool]]:
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
        prompt = _apply(tokenizer, template, conv, conv.turns[:i], True)
        full = _apply(tokenizer, template, conv, conv.turns[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(
                f"chat template is not prefix-preserving at turn {i} of {conv.source or 'a conversation'}: "
                "rendering a prefix of the conversation does not give a prefix of the full rendering"
            )
        body = full[len(prompt) :]
        start = body.find(turn.content)
        end = body.find(template.eos, start + len(turn.content) if start >= 0 else 0)
        if end < 0:
            raise ValueError(f"chat template does not end assistant turn {i} with {template.eos!r}")
        end += len(template.eos)
        out += [(prompt[len(done) :], False), (body[:end], turn.trained), (body[end:], False)]
        done = full
    whole = _apply(tokenizer, template, conv, conv.turns, generation_prompt)
    if not whole.startswith(done):
        raise ValueError(f"chat template is not prefix-preserving for {conv.source or 'a conversation'}")
    out.append((whole[len(done) :], False))
    return out


def render_segments(conv: Conversation, tokenizer, template: Template) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces whose concatenation is the full text.

    Raises:
        ValueError: see `_segments_chat_template`; unknown template mode.
    """
    return _segments(conv, tokenizer, template, False)


def _segments(conv: Conversation, tokenizer, template: Template, generation_prompt: bool) -> list[tuple[str, bool]]:
    if template.mode == "role_markers" or template.tools == "layout":
        conv = layout_turns(conv)
    if template.mode == "role_markers":
        return _segments_role_markers(conv, template, generation_prompt)
    if template.mode == "chat_template":
        return _segments_chat_template(conv, tokenizer, template, generation_prompt)
    raise ValueError(f"unknown template mode {template.mode!r}")


def _pieces(segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The units tokenized on their own: each trained segment, and each run of untrained ones."""
    out: list[tuple[str, bool]] = []
    for text, trained in segments:
        if out and not trained and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        elif text:
            out.append((text, trained))
    return out


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer) -> tuple[list[int], list[int]]:
    """Tokenize each piece (`_pieces`) on its own and concatenate: trained pieces are labelled with
    their own ids, everything else with -100 (see the module docstring)."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in _pieces(segments):
        piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return ids, labels


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
    """Token ids of the history plus the assistant opener (the generation prompt), for PPO and chat.

    Raises:
        ValueError: see `render_segments`.
    """
    return tokenize_segments(_segments(conv, tokenizer, template, True), tokenizer)[0]


def inserted_text(conv: Conversation, tokenizer, template: Template) -> str:
    """The text the template puts after the conversation's last assistant turn (its end-of-turn
    token included) up to the next assistant opener: the rendering of the tool results (or user
    turns) that follow it, then the generation prompt. A tool rollout inserts exactly this, tokenized
    on its own as `render_prompt` tokenizes it, so the rollout's ids are the training rendering's.

    Raises:
        ValueError: no assistant turn; see `render_segments`.
    """
    segments = _segments(conv, tokenizer, template, True)
    last = max((i for i, (_, trained) in enumerate(segments) if trained), default=None)
    if last is None:
        raise ValueError(f"{conv.source or 'a conversation'}: no assistant turn to continue after")
    return "".join(text for text, _ in segments[last + 1 :])


def render_scored(conv: Conversation, tokenizer, template: Template) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a conversation a reward model scores: the response is its last
    answer up to and including the end-of-turn token (where the reward is read); the prompt is
    everything before it, equal to `render_prompt` of the conversation without that answer.

    Raises:
        ValueError: the conversation has no trained span; see `render_segments`.
    """
    segments = render_segments(conv, tokenizer, template)
    last = max((i for i, (_, trained) in enumerate(segments) if trained), default=None)
    if last is None:
        raise ValueError(f"{conv.source or 'a conversation'}: no assistant answer to score")
    prompt = tokenize_segments(segments[:last], tokenizer)[0]
    response = tokenize_segments(segments[last : last + 1], tokenizer)[0]
    return prompt, response


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
        layout = getattr(data_cfg, "role_layout", "readme")
        if layout not in ROLE_LAYOUTS:
            raise ValueError(f"role_layout must be one of {ROLE_LAYOUTS}, got {layout!r}")
        return Template(
            "role_markers", eos, markers=dict(data_cfg.role_markers), system_prompt=system_prompt, layout=layout
        )
    if data_cfg.template != "chat_template":
        raise ValueError(f"template must be 'chat_template' or 'role_markers', got {data_cfg.template!r}")
    if not tokenizer.chat_template:
        raise ValueError("template=chat_template but the tokenizer has no chat template; use role_markers")
    tools = "native" if supports_tools(tokenizer, tokenizer.chat_template) else "layout"
    template = Template(
        "chat_template", eos, chat_template=tokenizer.chat_template, system_prompt=system_prompt, tools=tools
    )
    for probe in (_PROBE, _PROBE_NO_SYSTEM):
        try:
            render_segments(probe, tokenizer, template)
        except ValueError as err:
            raise ValueError(
                f"the tokenizer's chat template cannot be used for training: {err}; use role_markers"
            ) from err
    return template


def template_jinja(template: Template, tokenizer, tools: bool = False) -> Optional[str]:
    """A Jinja chat template that renders exactly what training saw, to save into the merged model:
    in role_markers mode the markers (with the default tool layout in front, so tool conversations
    render as trained); in chat_template mode None (the tokenizer's own template applies), except
    when tool conversations were trained (`tools`) in the default layout, which then goes in front
    of the tokenizer's template."""
    if template.mode != "role_markers":
        if tools and template.tools == "layout":
            return layout_jinja(template.system_prompt) + template.chat_template
        return None
    m = {k: jinja_string(v) for k, v in template.markers.items()}
    eos = jinja_string(template.eos)
    after = " + '\\n'" if template.layout == "code" else ""
    default_system = ""
    if template.system_prompt is not None:
        default_system = (
            "{%- if messages and messages[0]['role'] != 'system' -%}"
            f"{{{{ {m['system']} + {jinja_string(template.system_prompt)} + '\\n' }}}}"
            "{%- endif -%}"
        )
    return (
        layout_jinja(template.system_prompt)
        + default_system
        + "{%- for message in messages -%}"
        + f"{{%- if message['role'] == 'system' -%}}{{{{ {m['system']} + message['content'] + '\\n' }}}}"
        + f"{{%- elif message['role'] == 'user' -%}}{{{{ {m['user']} + message['content']{after} }}}}"
        + f"{{%- elif message['role'] == 'assistant' -%}}"
        f"{{{{ {m['assistant']} + message['content']{after} + {eos} + '\\n' }}}}"
        + "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
        + "{%- endif -%}{%- endfor -%}"
        + f"{{%- if add_generation_prompt -%}}{{{{ {m['assistant']} }}}}{{%- endif -%}}"
    )
