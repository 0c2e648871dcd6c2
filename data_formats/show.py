"""Print conversations with the trained tokens highlighted (ANSI colours).

    relay show FILE [--kind sft|rm|prompts|pt|kto|STAGE] [--template role_markers|chat_template]
                    [--model embedded] [-n 2] [--boundaries]

Green background: trained (label = token id); plain: not trained. Each token is shown by its own
decoded text, with '|' between tokens when --boundaries is given, so boundary effects are visible.
Every kind is shown as its stage reads it: sft the whole conversation (assistant turns and tool
calls trained; tool results, tool schemas and user turns not), rm both sides of a pair as scored
(the answer and its end-of-turn trained), prompts the generation prompt (nothing trained: the
policy's own completion is), pt the document (every token but the first trained), kto each answer
after its prompt with its label (the answer and its end-of-turn trained; a preference pair is two
answers, as the KTO stage unpairs it). `relay show` also takes a stage name for --kind (a DPO file is
shown as rm, a PPO or GRPO file as prompts: the kind of data the stage reads), as `relay validate` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from data_formats.formats import KINDS
from data_formats.render import IGNORE_INDEX, Template, make_template, render, render_prompt, render_scored
from data_formats.sources import summarize
from data_formats.validate import read_and_parse

TRAINED = "\033[42;30m"
RESET = "\033[0m"


def colour_tokens(ids: list[int], labels: list[int], tokenizer, boundaries: bool = False) -> str:
    """The decoded sample with trained tokens wrapped in ANSI colour codes."""
    out = []
    for token, label in zip(ids, labels):
        text = tokenizer.decode([token])
        if boundaries:
            text += "|"
        out.append(f"{TRAINED}{text}{RESET}" if label != IGNORE_INDEX else text)
    return "".join(out)


def labelled(kind: str, value, tokenizer, template: Template) -> list[tuple[str, list[int], list[int]]]:
    """(title, ids, labels) of each sequence a record of `kind` becomes (see the module docstring)."""
    if kind == "pt":
        ids = list(tokenizer(value, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return [("document", ids, [IGNORE_INDEX] + ids[1:])]
    if kind == "prompts":
        ids = render_prompt(value, tokenizer, template)
        return [("prompt", ids, [IGNORE_INDEX] * len(ids))]
    if kind == "rm":
        out = []
        for side, conv in zip(("chosen", "rejected"), value[:2]):
            prompt, answer = render_scored(conv, tokenizer, template)
            out.append((side, prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
        return out
    if kind == "kto":
        out = []
        for conv, desirable in value:
            prompt, answer = render_scored(conv, tokenizer, template)
            title = "desirable answer" if desirable else "undesirable answer"
            out.append((title, prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
        return out
    return [("conversation", *render(value, tokenizer, template))]


def main(argv: Optional[list[str]] = None) -> int:
    """The show command; returns the exit status (1 when the file has bad records)."""
    from pipeline.config import ChatDataConfig
    from pipeline.modeling.embedded import resolve_model_path
    from pipeline.modeling.models import load_tokenizer

    parser = argparse.ArgumentParser(prog="relay show", description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument(
        "--kind", choices=KINDS, default="sft", help="the kind of data (relay show also takes a stage name)"
    )
    parser.add_argument("--template", default="chat_template", choices=("chat_template", "role_markers"))
    parser.add_argument("--model", default="embedded")
    parser.add_argument("-n", type=int, default=2, help="how many conversations to show")
    parser.add_argument("--boundaries", action="store_true", help="mark token boundaries with '|'")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    template: Template = make_template(ChatDataConfig(template=args.template), tokenizer)
    good, problems = read_and_parse([args.file], args.kind)
    for line in summarize(problems):  # grouped as `relay validate` prints them
        print(line, file=sys.stderr)
    for record in good[: args.n]:
        for title, ids, labels in labelled(args.kind, record.value, tokenizer, template):
            trained = sum(label != IGNORE_INDEX for label in labels)
            print(f"--- {record.source} (task {record.task}) {title}: {len(ids)} tokens, {trained} trained")
            print(colour_tokens(ids, labels, tokenizer, args.boundaries))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
