"""The chat CLI: one-shot answers, side-by-side comparison, multi-turn history, template errors."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.tools.chat import ChatError, Generation, interactive, load_chat_model, main, prompt_ids, side_by_side


def test_one_shot_embedded_knows_paris(capsys):
    assert main(["--model", "embedded", "--prompt", "What is the capital of France?", "--max-new-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_prompt_ends_with_assistant_opener(tiny_model_dir):
    chat = load_chat_model(str(tiny_model_dir))
    ids = prompt_ids(chat.tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = chat.tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_compare_prints_both_models_side_by_side(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # the width the columns are cut to, whatever runs the test (xdist: 80)
    assert (
        main(
            [
                "--model",
                str(tiny_model_dir),
                "--compare",
                str(tiny_model_dir),
                "--prompt",
                "Hello",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    first, rule = capsys.readouterr().out.splitlines()[:2]
    title = str(tiny_model_dir)[:48]
    assert first.startswith(title) and first.count(" | ") == 1 and first.endswith(title)
    assert rule.count(" | ") == 1 and set(rule.replace(" | ", "").replace(" ", "")) == {"-"}


def test_interactive_keeps_history_and_resets(tiny_model_dir):
    chat = load_chat_model(str(tiny_model_dir))
    lines = iter(["first question", "second question", "/reset", "after reset", "/exit", "never read"])
    histories = interactive([chat], Generation(max_new_tokens=3), system="Sys", read=lambda _: next(lines))
    (history,) = histories
    assert [m["role"] for m in history] == ["system", "user", "assistant"]
    assert history[1]["content"] == "after reset"
    assert next(lines) == "never read"


def test_greedy_is_deterministic(tiny_model_dir):
    chat = load_chat_model(str(tiny_model_dir))
    from pipeline.tools.chat import reply

    messages = [{"role": "user", "content": "Count"}]
    assert reply(chat, messages, Generation(max_new_tokens=6)) == reply(chat, messages, Generation(max_new_tokens=6))


def test_folder_without_chat_template_is_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "nochat"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatError, match="no chat template"):
        load_chat_model(str(folder))


def test_side_by_side_wraps_columns():
    text = side_by_side("base", "one two three four five six", "final", "short", width=43)
    assert text.splitlines() == [
        "base                 | final",
        "----                 | -----",
        "one two three four   | short",
        "five six             |",
    ]


def test_generation_kwargs():
    assert Generation().kwargs()["do_sample"] is False
    sampled = Generation(temperature=0.7, top_p=0.9).kwargs()
    assert sampled["do_sample"] is True and sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9


def test_exit_words_and_commands_never_reach_the_model(tiny_model_dir, monkeypatch, capsys):
    import pipeline.tools.chat as chat_module

    sent = []
    monkeypatch.setattr(
        chat_module, "reply", lambda chat, messages, gen, stream=False: sent.append(messages[-1]["content"]) or "ok"
    )
    chat = load_chat_model(str(tiny_model_dir))
    for word in ("exit", "quit", "/quit", "/exit"):
        lines = iter(["/help", "/frobnicate", "hello", word, "never read"])
        interactive([chat], Generation(max_new_tokens=2), read=lambda _: next(lines))
        assert next(lines) == "never read"
    assert sent == ["hello"] * 4
    out = capsys.readouterr().out
    assert "commands: /reset clears the history" in out and "unknown command '/frobnicate'" in out


def test_chat_refuses_a_reward_model_before_loading(tiny_reward_dir, capsys, monkeypatch):
    import pipeline.modeling.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))
    assert main(["--model", str(tiny_reward_dir), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --model: {tiny_reward_dir} is a reward model (a sequence classifier); "
        "this needs a causal language model, e.g. the SFT stage's merged/"
    )


def test_chat_names_a_missing_folder_in_one_line(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --model: {tmp_path / 'nope'}: no such folder"


def test_an_answer_cut_at_the_token_limit_is_marked(tiny_model_dir, capsys):
    from pipeline.tools.chat import one_shot, was_cut

    assert was_cut([5, 6, 7], 3, [2]) and not was_cut([5, 2], 3, [2]) and not was_cut([5, 6, 2], 3, [2])
    model = load_chat_model(str(tiny_model_dir))
    model.model.generation_config.eos_token_id = None  # the random model must run to the limit
    one_shot([model], "Hello", Generation(max_new_tokens=4))
    assert "[answer cut at 4 tokens: --max-new-tokens raises the limit]" in capsys.readouterr().out


def test_stream_printer_holds_a_split_character_until_its_rest_arrives(capsys):
    """A character whose bytes span two tokens is printed once, whole; the reply ends with a newline."""
    from pipeline.tools.chat import StreamPrinter

    pieces = {1: "caf", 2: "\ufffd", 3: "é!"}

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            text = "".join(pieces[i] for i in ids)
            return text.replace("\ufffdé", "é") if ids[-1] == 3 else text

    printer = StreamPrinter(Tok())
    for token in (1, 2, 3):
        assert printer(0, token) is False
    printer.close()
    assert capsys.readouterr().out == "café!\n"


def test_a_conversation_past_the_models_context_is_one_line_and_the_turn_is_taken_back(tiny_model_dir, capsys):
    """The chat kept answering past the model's context (the server refuses such a request with
    context_length_exceeded): a turn whose prompt and --max-new-tokens pass it is one line, the
    conversation stays as it was, and /reset starts again; --prompt ends in one error line, exit 2."""
    chat = load_chat_model(str(tiny_model_dir))
    first = len(prompt_ids(chat.tokenizer, [{"role": "user", "content": "first question"}]))
    chat.context = first + 4  # room for the first turn's answer and no more
    lines = iter(["first question", "a second question that cannot fit", "/reset", "first question", "/exit"])
    (history,) = interactive([chat], Generation(max_new_tokens=4), read=lambda _: next(lines))
    out = capsys.readouterr().out
    assert f"with --max-new-tokens 4 it passes {chat.name}'s context of {first + 4} tokens: /reset starts" in out
    assert [m["role"] for m in history] == ["user", "assistant"] and history[0]["content"] == "first question"
    long = "word " * 400
    code = main(["--model", str(tiny_model_dir), "--prompt", long * 10, "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: the conversation is") and "Traceback" not in err
