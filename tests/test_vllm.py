"""vLLM, run from its own environment (bench/.venv-vllm, run_scripts/install_vllm.sh) as a server
on 127.0.0.1: `relay serve --backend vllm` answers the official `openai` client with the protocol
checks tests/test_serve.py runs against the FastAPI server where they apply (greedy answers equal
`relay chat`'s, streaming equals non-streaming, `n`, `stop`, text-part content, OpenAI-style
errors), with --api-key on every route of vLLM's server and Relay's role check, and stops its
engine on SIGTERM; the RL backend's server needs its own key on every route; and the `vllm`
generation backend follows the policy (LoRA adapter or full weights: its
greedy tokens equal the trainer's after optimizer steps) with its log-probs within fp32 noise of
the trainer's, a resumed GRPO run on a fresh server samples what an unbroken one does, and the PPO and
GRPO stages train on it, with tools and without, LoRA and full weights, with the mismatch logged and
every correction applied as it is defined (tis, the default for vllm; mis; none) (`CORRECTED`).

Cheap by sharing (a server start is most of the time): one engine server for the whole module
(`engine_server`, runtime LoRA and the full-weight sync both on; the generators, the gold table,
chat and the tool rollouts take turns on it, each given its own base weights first), and only the
resumed run and `relay serve` start their own: three starts for fifty-two tests. run_scripts/test.sh
builds the side environment in the background while the rest of the suite runs; these tests run last
(tests/conftest.py), wait for that install and fail when it failed. Run alone without the environment
(no RELAY_VLLM_INSTALL_STATUS), they skip. Every server started here is stopped in teardown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from tinymodels import make_eos_prone, make_tiny_model

from pipeline.modeling.vllm_server import VLLMServer, free_port, vllm_python

INSTALL_WAIT_S = float(os.environ.get("RELAY_VLLM_INSTALL_WAIT_S", 1200))
"""How long the first vLLM test waits for run_scripts/test.sh's background install."""


def install_status() -> Path | None:
    """The prefix of the background install's files (.log, .rc) run_scripts/test.sh started, or None."""
    prefix = os.environ.get("RELAY_VLLM_INSTALL_STATUS", "")
    return Path(prefix) if prefix else None


@pytest.fixture(scope="session", autouse=True)
def vllm_ready():
    """Waits for run_scripts/test.sh's install of the side environment; a failed install is a
    failure of every test here (with the log's tail), never a skip."""
    status = install_status()
    if status is not None:
        rc_file, log = Path(f"{status}.rc"), Path(f"{status}.log")
        deadline = time.monotonic() + INSTALL_WAIT_S
        while not rc_file.exists():
            if time.monotonic() > deadline:
                pytest.fail(
                    f"run_scripts/install_vllm.sh did not finish within {INSTALL_WAIT_S:.0f} s (its log: {log})"
                )
            time.sleep(1)
        rc = rc_file.read_text().strip()
        if rc != "0":
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            pytest.fail(f"run_scripts/install_vllm.sh failed with exit code {rc} (its log: {log}):\n{tail}")
    if vllm_python() is None:
        if status is not None:
            pytest.fail(
                "run_scripts/install_vllm.sh finished but "
                "no vLLM interpreter is found (RELAY_VLLM_PYTHON, bench/.venv-vllm)"
            )
        pytest.skip("vLLM's environment is absent: bash run_scripts/install_vllm.sh (run_scripts/test.sh builds it)")


HI = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    """The tiny random causal LM with vLLM's smallest CPU attention head (head_dim 32, not 16)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("vllm") / "tiny", seed=0, num_attention_heads=2, num_key_value_heads=1
    )


@pytest.fixture(scope="module")
def vllm_untied(tmp_path_factory):
    """As vllm_tiny, with an output head of its own (full fine-tuning's weight sync needs one)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("vllm") / "untied",
        seed=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def engine_server(vllm_untied, tmp_path_factory):
    """One engine server on vllm_untied for every generator here: runtime LoRA and the full-weight
    sync both on (one start instead of two: each start is most of these tests' time). Its compile
    cache is a folder of its own (`server.compile_cache`), which an eager server on a CPU leaves
    empty."""
    from pipeline.rl.vllm_generator import engine_options

    opts = engine_options(8)
    opts.dev_mode = True
    cache = tmp_path_factory.mktemp("vllm-compile-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # read once, by the server's start
        server = VLLMServer(str(vllm_untied), opts, log_path=tmp_path_factory.mktemp("vllm-log") / "engine.log")
        server.start()
    server.compile_cache = cache
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shared_server(engine_server, vllm_untied):
    """`engine_server` with the folder's own weights again (a full fine-tuning test synced others)."""
    engine_server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(vllm_untied)}})
    engine_server.post("/reset_prefix_cache", {})
    return engine_server


def test_every_route_of_the_engine_server_needs_its_key(engine_server, vllm_untied):
    """The RL backend's server (development routes and runtime LoRA on) refuses every route of its
    OpenAPI schema without its per-server key, the weight reload among them; `post` sends the key."""
    import urllib.error

    def status(path, method="POST", headers=None):
        request = urllib.request.Request(
            engine_server.base_url + path,
            b"{}" if method == "POST" else None,
            {"Content-Type": "application/json", **(headers or {})},
            method=method,
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    code, schema = status("/openapi.json", "GET", engine_server.headers)
    routes = [
        (m.upper(), p.replace("{", "").replace("}", "")) for p, ops in json.loads(schema)["paths"].items() for m in ops
    ]
    assert {("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/v1/load_lora_adapter")} <= set(
        routes
    )
    for method, path in routes:
        if (method, path) != ("GET", "/health"):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                assert status(path, method, headers)[0] == 401, (method, path, headers)
    engine_server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(vllm_untied)}})


def on_server(server, folder, workdir):
    """A GRPO/PPO `generator_factory` sampling on the shared `server` (the stage's generation config)."""
    from transformers import AutoTokenizer

    from pipeline.rl.vllm_generator import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(folder)

    def factory(policy, max_new_tokens=8, temperature=1.0):
        return VLLMGenerator(
            policy,
            str(folder),
            workdir,
            tok.pad_token_id,
            [tok.eos_token_id],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            server=server,
        )

    return factory


CORRECTED = [
    pytest.param(adapter, correction, id=f"{adapter}-{correction}")
    for adapter in ("lora", "full")
    for correction in ("auto", "none", "mis")
]
"""(model.finetuning, generation.correction) of the PPO and GRPO runs on vLLM, with tools and without (auto is tis
on vllm); QLoRA has runs of its own (`TOOLED`, `QLORA_CASES`)."""
TOOLED = CORRECTED + [
    pytest.param("qlora", correction, id=f"qlora-{correction}") for correction in ("auto", "none", "mis")
]
"""The tool runs on vLLM: `CORRECTED` and QLoRA (whose engine samples the unquantized base with the adapter)."""
MIS_CAP, MIS_SKEW = 1.0, 5e-5
"""generation.correction_cap of the mis runs, and the skew they add to the engine's reported log-probs (alternately
-/+ on each request's tokens): the engine's own log-probs are the trainer's within fp32 noise, often exactly, so the
skew, well within what the runs' checks allow the engine (mean 1e-4), decides which side of the cap each token's
p_trainer / p_engine falls: about half the sampled tokens drop out (each run checks that some do and some stay)."""


def set_correction(cfg, correction: str, monkeypatch) -> None:
    from pipeline.rl.vllm_generator import VLLMGenerator

    cfg.generation.correction = correction
    assert cfg.generation.correction_name == ("tis" if correction == "auto" else correction)
    if correction != "mis":
        return
    cfg.generation.correction_cap = MIS_CAP
    real = VLLMGenerator.request

    def request(self, *args, **kwargs):
        ids, values = real(self, *args, **kwargs)
        return ids, [v + (MIS_SKEW if i % 2 else -MIS_SKEW) for i, v in enumerate(values)]

    monkeypatch.setattr(VLLMGenerator, "request", request)


def check_correction(gen, old, engine, mask, weight) -> tuple[int, int]:
    """The weight the stage put on each token's policy loss is its correction's of the step's trainer (`old`) and
    engine log-probs of the sampled tokens, 1 off them (pipeline/algorithms/mismatch.py `correction_weights`, its
    TIS and MIS pinned against TRL in tests/test_mismatch.py); none: no weight at all. Returns (tokens dropped,
    tokens kept) among the sampled ones."""
    from pipeline.algorithms.mismatch import correction_weights

    inside = mask.bool()
    assert engine is not None and not engine[inside].isnan().any()
    want = correction_weights(gen.correction_name, old, engine, mask.float(), gen.correction_cap, gen.correction_floor)
    if want is None:
        assert weight is None
        return 0, int(inside.sum())
    torch.testing.assert_close(weight, want, rtol=0, atol=1e-6)
    return int((inside & (weight == 0)).sum()), int((inside & (weight != 0)).sum())


def check_dropped(gen, counts: list[tuple[int, int]]) -> None:
    """mis dropped some sampled tokens and kept others over the run; the other corrections drop none."""
    dropped, kept = (sum(column) for column in zip(*counts))
    assert kept > 0 and (dropped > 0) == (gen.correction_name == "mis"), (dropped, kept)


SERVE_KEY = "sk-relay-vllm-0123456789"


@pytest.fixture(scope="module")
def serve_tmp():
    """The temporary folder `relay serve` runs with (`serve_process`): a short one, as a user's is
    (pytest's are too deep for vLLM's socket paths in a folder of their own, which then go to /tmp:
    tests/test_vllm_serve.py)."""
    folder = Path(tempfile.mkdtemp(prefix="serve-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def serve_process(vllm_tiny, serve_tmp, tmp_path_factory):
    """(process, its engine processes, base URL) of `relay serve --backend vllm --eager` with
    SERVE_KEY (from RELAY_API_KEY) on a free port (eager: on a CPU a compiled start takes ~20 s
    more here, its compile cache never loading back), TMPDIR `serve_tmp`. The last test on it
    signals it (test_sigterm_to_relay_serve_stops_the_engine); whatever is left is killed in teardown."""
    from test_vllm_serve import alive, start_serve

    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "serve.log"
    env = {**os.environ, "RELAY_API_KEY": SERVE_KEY, "TMPDIR": str(serve_tmp)}
    proc, engine = start_serve(vllm_tiny, port, log, env, ("--eager",))
    try:
        yield proc, engine, f"http://127.0.0.1:{port}"
    finally:
        for pid in alive(engine | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(serve_process):
    """(openai client with the key, base URL) of `serve_process`."""
    import openai

    base = serve_process[2] + "/v1"
    return openai.OpenAI(base_url=base, api_key=SERVE_KEY, max_retries=0, timeout=120), base


def ask(client, **kwargs):
    return client.chat.completions.create(
        **{"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0, **kwargs}
    )


def test_serve_vllm_answers_the_openai_client_as_relay_chat_does(served, vllm_tiny):
    from test_serve import streamed

    from pipeline.tools.chat import Generation, load_chat_model, prompt_ids, reply

    client, _ = served
    chat = load_chat_model(str(vllm_tiny))
    answer = ask(client)
    (choice,) = answer.choices
    assert choice.message.content.strip() == reply(chat, HI, Generation(max_new_tokens=8))  # greedy, same template
    assert answer.model == "tiny" and choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(prompt_ids(chat.tokenizer, HI)) and answer.usage.completion_tokens <= 8
    texts, reasons, used = streamed(
        client
    )  # vLLM refuses n > 1 with greedy sampling (400); the FastAPI server allows it
    assert texts == {0: choice.message.content} and reasons == {0: choice.finish_reason}
    assert used.completion_tokens == answer.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_serve_vllm_n_stop_text_parts(served):
    client, _ = served
    full = ask(client, max_tokens=12).choices[0].message.content
    sampled = ask(client, n=3, temperature=1.0, top_p=0.9)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = ask(client, max_tokens=12, stop=[stop, "never appears"]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me a story "}, {"type": "text", "text": "about a cat."}],
        }
    ]
    assert ask(client, max_tokens=12, messages=as_parts).choices[0].message.content == full


VLLM_BAD = [
    ({"max_tokens": -5}, 400),
    ({"model": "gpt-4o"}, 404),
    ({"n": 0}, 400),
    ({"temperature": -1}, 400),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400),
]  # longer than --max-model-len


def test_serve_vllm_bad_requests_are_openai_errors_and_the_server_stays_up(served):
    import openai

    client, _ = served
    for kwargs, status in VLLM_BAD:
        with pytest.raises(openai.APIStatusError) as caught:
            ask(client, **kwargs)
        assert caught.value.status_code == status, (kwargs, caught.value.body)
        assert {"message", "type"} <= set(caught.value.body) and caught.value.body["message"], (
            kwargs,
            caught.value.body,
        )
    assert ask(client).choices[0].message.content is not None  # still up


def test_serve_vllm_needs_the_key_on_every_route(serve_process):
    """Every route of vLLM's server, read from its own OpenAPI schema, and the paths outside it
    (/openapi.json, /docs, /metrics, one no route has) answer 401 without the key or with a wrong
    one, and get past the guard with it (a body that is not JSON: the route itself refuses it, so
    nothing runs); only GET /health is open."""
    from test_vllm_serve import call

    base, key = serve_process[2], SERVE_KEY
    status, text = call(base + "/openapi.json", key=key)
    routes = [(m.upper(), p) for p, ops in json.loads(text)["paths"].items() for m in ops]
    assert {
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/chat/completions"),
    } <= set(routes)
    outside = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("POST", "/no-such-route")]
    for method, template in routes + outside:
        if (method, template) == ("GET", "/health"):
            continue  # the liveness probe, open as on Relay's own server
        path, body = template.replace("{", "").replace("}", ""), b"{" if method == "POST" else None
        for given, code in ((None, "missing_api_key"), ("sk-wrong", "invalid_api_key")):
            status, text = call(base + path, method, body, given)
            assert status == 401 and json.loads(text)["error"]["code"] == code, (
                method,
                path,
                given,
                status,
                text[:200],
            )
        status, text = call(base + path, method, body, key)
        assert status != 401, (method, path, status, text[:200])
        if method == "GET" and "{" not in template:  # nothing to refuse: served
            assert status == 200, (method, path, status, text[:200])
    assert call(base + "/health") == (200, b"")
    print(f"{len(routes) + len(outside) - 1} routes of relay serve --backend vllm refused without the key")


def test_serve_vllm_refuses_the_roles_relays_server_refuses(serve_process, served):
    """A message with role `wizard` gets Relay's own 400 on every route that takes messages (vLLM
    alone answers it); streaming answers pass the guard unchanged."""
    import openai
    from test_vllm_serve import call

    from pipeline.tools.openai_protocol import ApiError, check_request

    wizard = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Obey."}]
    with pytest.raises(ApiError) as relay:
        check_request({"model": "tiny", "messages": wizard}, "tiny")
    for path, messages in (
        ("/v1/chat/completions", wizard),
        ("/invocations", wizard),
        ("/tokenize", wizard),
        ("/v1/chat/completions/batch", [wizard]),
    ):
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 4}).encode()
        status, text = call(serve_process[2] + path, "POST", body, SERVE_KEY)
        assert status == 400, (path, status, text[:300])
        if path != "/v1/chat/completions/batch":
            assert json.loads(text) == relay.value.body(), path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[1], api_key="sk-wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=HI, max_tokens=4
        )


def test_sigterm_to_relay_serve_stops_the_engine(serve_process, serve_tmp):
    """Last on `serve_process` (it stops it): SIGTERM to `relay serve` alone leaves no engine
    process (vLLM's server, its engine core, its resource tracker), a free port, and nothing in
    the temporary folder but torch's compile cache (vLLM's IPC sockets and rendezvous file went
    into a folder of the server's own, now removed)."""
    from test_vllm_serve import assert_stopped_with_its_parent

    proc, engine, base = serve_process
    assert_stopped_with_its_parent(proc, engine, int(base.rsplit(":", 1)[1]), signal.SIGTERM)
    assert [p.name for p in serve_tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


# ------------------------------------------------------------------------------------------
# generation.backend: vllm (pipeline/rl/vllm_generator.py)
# ------------------------------------------------------------------------------------------


def trainer_greedy(policy, prompts, n, eos):
    """The trainer policy's own greedy tokens (transformers' generate, fp32), cut at EOS."""
    from transformers import GenerationConfig

    from pipeline.rl.rollout import cut_at_eos

    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0])
    device = next(policy.parameters()).device
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = policy.generate(
                input_ids=torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                generation_config=config,
            )
            out.append(cut_at_eos(ids[0, len(p) :].tolist(), eos)[0])
    return out


def test_vllm_generator_follows_the_lora_policy_and_scores_like_the_trainer(vllm_untied, shared_server, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.algorithms.mismatch import logprob_diff
    from pipeline.algorithms.rl import logprobs_from_logits
    from pipeline.rl.rollout import assemble, cut_at_eos, policy_logits
    from pipeline.rl.vllm_generator import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(vllm_untied)
    eos = [tok.eos_token_id]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(vllm_untied, dtype=torch.float32)
    policy = get_peft_model(
        base,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    prompts = [
        tok("Tell me a story about a cat.")["input_ids"],
        tok("Hi there")["input_ids"],
        tok("One two three")["input_ids"],
    ]
    target = torch.tensor([prompts[0] + tok(" the cat sat on the mat")["input_ids"]])
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    gen = VLLMGenerator(
        policy,
        str(vllm_untied),
        tmp_path / "vllm",
        tok.pad_token_id,
        eos,
        max_new_tokens=12,
        max_num_seqs=4,
        server=shared_server,
    )
    try:
        before = trainer_greedy(policy, prompts, 12, eos)
        for k in (3, 2):  # k optimizer steps, then the engine must follow
            for _ in range(k):
                policy(input_ids=target, labels=target).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            want = trainer_greedy(policy, prompts, 12, eos)
            got = [cut_at_eos(ids, eos)[0] for ids in gen.generate(prompts, temperature=0.0)]
            assert got == want
        assert want != before  # the steps did change the policy's answers: the sync is what makes them equal
        torch.manual_seed(1)
        sampled = gen.generate(prompts * 2)  # temperature 1: rows sharing a prompt get their own seeds
        rollout = assemble(prompts * 2, sampled, tok.pad_token_id, eos)
        engine = torch.full(rollout.response_mask.shape, float("nan"))
        for row, (ids, lp) in enumerate(zip(rollout.responses, gen.last_logprobs)):
            engine[row, : len(ids)] = torch.tensor(lp[: len(ids)])
        with torch.no_grad():
            logits = policy_logits(policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
        trainer = logprobs_from_logits(logits.float(), rollout.response_ids)
        mean, worst = logprob_diff(trainer, engine, rollout.response_mask)
        print(
            f"vLLM vs trainer log-probs over {int(rollout.response_mask.sum())} "
            f"sampled tokens: mean {mean:.2e}, max {worst:.2e}"
        )
        assert worst < 1e-3 and mean < 1e-4
        torch.manual_seed(1)
        assert gen.generate(prompts * 2) == sampled  # seeded from torch's RNG: the same draw again
        if not torch.cuda.is_available():  # eager on a CPU: not even vLLM's log-prob ranks compile
            assert not any(shared_server.compile_cache.iterdir())
    finally:
        gen.close()


def grpo_cfg(out, model, finetuning="lora", steps=2):
    from test_grpo import make_cfg

    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(out, model, prompts, max_steps=steps, learning_rate=1e-2, seq_length=256)
    cfg.grpo.reward_funcs = ["test_mismatch:completion_chars"]
    cfg.generation.backend, cfg.generation.max_new_tokens, cfg.model.finetuning = "vllm", 8, finetuning
    assert cfg.generation.correction_name == "tis"
    return cfg


def grpo_run(cfg, monkeypatch, factory=None, stop=None):
    """Run the GRPO stage; per step: (figures, sampled response ids, the server it sampled on)."""
    from stagerun import run_stage

    from stages import grpo

    if stop is None:
        monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
    else:
        monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
    seen = {}
    record = lambda st, m: seen.__setitem__(st.step, (m, st.last_rollout["rollout"].responses, st._generator.server))  # noqa: E731
    stage = run_stage(grpo.GRPOStage, cfg, on_step=record, generator_factory=factory)
    for step, (figures, _, _) in seen.items():
        print(
            f"step {step}: logprob diff mean {figures['rollout/logprob_diff_mean']:.2e} max "
            f"{figures['rollout/logprob_diff_max']:.2e}"
        )
        assert figures["rollout/logprob_diff_max"] < 1e-3  # the engine sampled from the updated weights
    return stage, seen


def test_grpo_on_vllm_resumed_on_a_fresh_server_samples_as_an_unbroken_run(
    vllm_untied, shared_server, tmp_path, monkeypatch
):
    """`generation.backend: vllm` end to end with LoRA: 4 unbroken GRPO steps vs 2, then 2 resumed
    on a server the resumed stage starts itself (fresh: no state of the first one), sample the
    same ids at every step: each row's seed is drawn from torch's RNG, which the checkpoint
    restores, and vLLM's per-request seeded sampler depends on nothing else. The stage stops the
    server it started."""
    _, unbroken = grpo_run(
        grpo_cfg(tmp_path / "a", vllm_untied, steps=4),
        monkeypatch,
        on_server(shared_server, vllm_untied, tmp_path / "va"),
    )
    first, before = grpo_run(
        grpo_cfg(tmp_path / "b", vllm_untied, steps=4),
        monkeypatch,
        on_server(shared_server, vllm_untied, tmp_path / "vb"),
        stop=2,
    )
    assert first.step == 2 and sorted(before) == [1, 2]
    cfg = grpo_cfg(tmp_path / "b", vllm_untied, steps=4)
    cfg.checkpoint.resume = True
    resumed, after = grpo_run(cfg, monkeypatch)  # the stage's own server
    assert sorted(after) == [3, 4] and resumed.final_summary["steps"] == 4
    for step, (figures, responses, _) in {**before, **after}.items():
        assert responses == unbroken[step][1], step
        assert figures["train/loss"] == pytest.approx(unbroken[step][0]["train/loss"], rel=1e-4, abs=1e-6), step
    fresh = after[4][2]
    assert fresh is not shared_server and fresh.proc.poll() is not None  # its own server, stopped when the stage ended


def ppo_cfg(out, model, reward, finetuning="lora", steps=2):
    from test_ppo import make_cfg

    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(out, model, reward, prompts, max_steps=steps, learning_rate=1e-2, seq_length=256)
    cfg.generation.backend, cfg.generation.max_new_tokens, cfg.model.finetuning = "vllm", 8, finetuning
    return cfg


def spy_grpo(monkeypatch) -> tuple[list, list]:
    """Every GRPO update's (rollout, scored) and every policy-loss call's `is_weight`, from now on."""
    from pipeline.rl import grpo as algo

    updates, weights, real_loss, real_update = [], [], algo.grpo_loss, algo.grpo_update
    monkeypatch.setattr(
        algo,
        "grpo_loss",
        lambda *a, is_weight=None, **k: weights.append(is_weight) or real_loss(*a, is_weight=is_weight, **k),
    )
    monkeypatch.setattr(algo, "grpo_update", lambda *a, **k: updates.append((a[2], dict(a[4]))) or real_update(*a, **k))
    return updates, weights


@pytest.mark.parametrize("adapter, correction", [c for c in CORRECTED if c.values != ("lora", "auto")])
def test_grpo_stage_on_vllm_applies_its_correction(
    adapter, correction, vllm_untied, shared_server, tmp_path, monkeypatch
):
    """Two GRPO steps on the shared server, LoRA or full weights (reloaded into the server before each rollout), with
    each correction: the engine samples the updated policy at every step (`grpo_run`), and every policy-loss call
    gets the correction's weights of that step's log-probs (none: no weight); mis drops some tokens and keeps
    others. LoRA with tis, the default, is the resumed run above."""
    cfg = grpo_cfg(tmp_path / "out", vllm_untied, adapter)
    set_correction(cfg, correction, monkeypatch)
    updates, weights = spy_grpo(monkeypatch)
    stage, _ = grpo_run(cfg, monkeypatch, on_server(shared_server, vllm_untied, tmp_path / "v"))
    assert stage.final_summary["steps"] == 2 and len(updates) == 2
    counts = [
        check_correction(
            cfg.generation, scored.get("old"), rollout.engine_logp, rollout.response_mask, scored.get("is_weight")
        )
        for rollout, scored in updates
    ]
    check_dropped(cfg.generation, counts)
    assert weights and all((w is None) == (cfg.generation.correction_name == "none") for w in weights)


@pytest.mark.parametrize("adapter, correction", CORRECTED)
def test_ppo_stage_on_vllm_logs_the_mismatch_and_applies_its_correction(
    adapter, correction, vllm_untied, tiny_reward_dir, shared_server, tmp_path, monkeypatch
):
    """`generation.backend: vllm` for the PPO stage, LoRA or full weights, 2 steps on the shared server: it trains,
    logs rollout/logprob_diff_mean/_max to TensorBoard (the engine sampled the updated policy: within fp32 noise),
    and every policy-loss call gets the correction's weights (`check_correction`, recomputed here from the step's
    own tensors): with `correction` left at auto TIS's, exp(trainer - engine log-prob) capped at correction_cap;
    mis's (some tokens dropped); none: no weight."""
    from stagerun import run_stage

    from pipeline.rl import ppo as algo
    from pipeline.tools.report import read_scalars
    from stages import ppo

    cfg = ppo_cfg(tmp_path / "out", vllm_untied, tiny_reward_dir, adapter)
    cfg.tracking.trackers = ["tensorboard"]
    assert cfg.generation.correction == "auto" and cfg.generation.correction_name == "tis"
    set_correction(cfg, correction, monkeypatch)
    weights = []
    real_loss = algo.policy_loss
    monkeypatch.setattr(
        algo, "policy_loss", lambda *a, weight=None, **k: weights.append(weight) or real_loss(*a, weight=weight, **k)
    )
    seen = {}
    record = lambda st, m: seen.__setitem__(st.step, (m, st.last_experience))  # noqa: E731
    stage = run_stage(
        ppo.PPOStage, cfg, on_step=record, generator_factory=on_server(shared_server, vllm_untied, tmp_path / "v")
    )
    assert stage.final_summary["steps"] == 2 and sorted(seen) == [1, 2]
    counts = []
    for step, (figures, exp) in seen.items():
        mask = exp.rollout.response_mask
        assert mask.sum() > 0 and not exp.rollout.engine_logp[mask.bool()].isnan().any()
        counts.append(check_correction(cfg.generation, exp.old_logprobs, exp.rollout.engine_logp, mask, exp.is_weight))
        print(
            f"PPO {adapter} {correction} step {step}: logprob diff mean {figures['rollout/logprob_diff_mean']:.2e} "
            f"max {figures['rollout/logprob_diff_max']:.2e}"
        )
        assert figures["rollout/logprob_diff_max"] < 1e-3  # the engine sampled from the updated weights
    check_dropped(cfg.generation, counts)
    assert weights and all((w is None) == (correction == "none") for w in weights)  # every policy-loss call
    scalars = read_scalars(tmp_path / "out")
    assert [s for s, _ in scalars["rollout/logprob_diff_mean"]] == [1, 2] and [
        s for s, _ in scalars["rollout/logprob_diff_max"]
    ] == [1, 2]
    assert stage._generator is None and shared_server.proc.poll() is None  # released, the shared server left running


class PolicyStates:
    """A policy's trained weights at every rollout (the adapter's under LoRA and QLoRA, else all of them: `capture`
    before the first rollout and after every step), and the log-probs an engine that follows the policy reports for
    a rollout drawn with them (`logprobs`): those weights on the base model's own unquantized weights (`folder`),
    in transformers, fp32, at the sampling temperature."""

    def __init__(self, folder):
        self.folder, self.policy, self.states = folder, None, []

    def trained(self) -> dict:
        from peft import get_peft_model_state_dict

        p = self.policy
        return get_peft_model_state_dict(p) if hasattr(p, "peft_config") else p.state_dict()

    def capture(self, policy=None) -> None:
        self.policy = policy if policy is not None else self.policy
        self.states.append({k: v.detach().clone() for k, v in self.trained().items()})

    def factory(self, make):
        """`make` (a generator factory) capturing the policy's weights as the stage hands it over."""

        def wrapped(policy, *args, **kwargs):
            self.capture(policy)
            return make(policy, *args, **kwargs)

        return wrapped

    def moved(self) -> bool:
        """Whether the first step changed the weights (so the second rollout's equality is the sync's)."""
        return any(not torch.equal(self.states[1][k], self.states[0][k]) for k in self.states[0])

    def logprobs(self, index: int, rollout, temperature: float = 1.0) -> torch.Tensor:
        import copy

        from peft import get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        from pipeline.algorithms.rl import logprobs_from_logits
        from pipeline.rl.rollout import policy_logits

        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32)
        if hasattr(self.policy, "peft_config"):
            model = get_peft_model(model, copy.deepcopy(self.policy.peft_config["default"]))
            set_peft_model_state_dict(model, self.states[index])
        else:
            model.load_state_dict(self.states[index])
        with torch.no_grad():
            logits = policy_logits(model.eval(), rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
        return logprobs_from_logits(logits.float() / temperature, rollout.response_ids)

    def engine_gap(self, index: int, rollout, temperature: float = 1.0) -> float:
        """max |engine - expected| log-prob over the rollout's sampled tokens."""
        mask = rollout.response_mask.bool()
        assert rollout.engine_logp is not None and not rollout.engine_logp[mask].isnan().any()
        return (self.logprobs(index, rollout, temperature) - rollout.engine_logp)[mask].abs().max().item()


QLORA_CASES = [
    pytest.param(stage, correction, id=f"{stage}-{correction}")
    for stage in ("ppo", "grpo")
    for correction in ("auto", "none", "mis")
]
"""(stage, generation.correction) of the QLoRA runs on vLLM (tools off)."""


@pytest.mark.parametrize("stage_name, correction", QLORA_CASES)
def test_a_qlora_policy_samples_on_vllm_as_its_adapter_on_the_unquantized_base(
    stage_name, correction, vllm_untied, tiny_reward_dir, shared_server, tmp_path, monkeypatch
):
    """QLoRA on vLLM: the server holds the base model's own (unquantized) weights and takes the policy's adapter
    before every rollout, so the engine samples from base + adapter while the trainer scores with the 4-bit base +
    adapter. Two steps of PPO and GRPO: at every step the engine's log-probs of the sampled tokens equal those of
    the unquantized base with the adapter the rollout was drawn with (`PolicyStates`, within the fp32 noise the
    other vLLM tests allow; a stale adapter at step 2 parts them), the trainer's differ from them by the
    quantization error (the mismatch the correction is for, logged as rollout/logprob_diff_*), and the
    correction's weights are its definition of the step's log-probs (`check_correction`)."""
    from stagerun import run_stage

    from stages import grpo, ppo

    out = tmp_path / "out"
    if stage_name == "ppo":
        cfg, stage_class = ppo_cfg(out, vllm_untied, tiny_reward_dir, "qlora"), ppo.PPOStage
    else:
        cfg, stage_class = grpo_cfg(out, vllm_untied, "qlora"), grpo.GRPOStage
    set_correction(cfg, correction, monkeypatch)
    assert cfg.generation.temperature == 1.0  # the engine's log-probs are of the distribution the trainer scores
    updates, _ = spy_grpo(monkeypatch)
    states, steps = PolicyStates(vllm_untied), {}

    def on_step(stage, figures):
        if stage_name == "ppo":
            exp = stage.last_experience
            steps[stage.step] = (figures, exp.rollout, exp.old_logprobs, exp.is_weight)
        else:
            rollout, scored = updates[stage.step - 1]
            steps[stage.step] = (figures, rollout, scored["old"], scored.get("is_weight"))
        states.capture()  # the next rollout's adapter

    factory = states.factory(on_server(shared_server, vllm_untied, tmp_path / "v"))
    stage = run_stage(stage_class, cfg, on_step=on_step, generator_factory=factory)
    assert stage.final_summary["steps"] == 2 and sorted(steps) == [1, 2] and states.moved()
    assert any("4bit" in type(m).__name__ for m in states.policy.modules())  # the trainer's base is quantized
    counts = []
    for step, (figures, rollout, trainer, weight) in steps.items():
        gap = states.engine_gap(step - 1, rollout)
        print(
            f"QLoRA {stage_name} {correction} step {step}: engine vs base+adapter max {gap:.2e}; vs the "
            f"trainer mean {figures['rollout/logprob_diff_mean']:.2e} max {figures['rollout/logprob_diff_max']:.2e}"
        )
        assert gap < 1e-3  # the engine sampled this step's adapter on the unquantized base
        assert figures["rollout/logprob_diff_max"] > 10 * max(gap, 1e-6)  # the 4-bit trainer is elsewhere
        counts.append(check_correction(cfg.generation, trainer, rollout.engine_logp, rollout.response_mask, weight))
    stale = states.engine_gap(0, steps[2][1])
    assert stale > 1e-3, stale  # the first adapter does not explain step 2's draws: the check sees a stale engine
    check_dropped(cfg.generation, counts)


@pytest.mark.parametrize("adapter", ["lora", "full", "qlora"])
def test_distill_samples_the_student_on_vllm(adapter, vllm_untied, shared_server, tmp_path, monkeypatch):
    """`generation.backend: vllm` in the distill stage: two on-policy steps (lmbda 1) whose student samples on the
    shared server at temperature 0.7, LoRA, full weights or QLoRA, the teacher in this process. At each step the
    engine's log-probs of the sampled tokens are the student's as it was when the rollout was drawn (`PolicyStates`:
    its weights on the unquantized base; a stale student at step 2 parts them), and the student learns. The stage's
    `rollout/logprob_diff_*` compare them with the student's in its own forward at the sampling temperature: fp32
    noise with LoRA and full weights (at another temperature they part by ~0.1), the 4-bit base's error with QLoRA."""
    from stagerun import run_stage

    from stages.distill import DistillStage

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(4)))
    teacher = make_tiny_model(
        tmp_path / "teacher", seed=3, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.6
    )
    argv = [
        *("--model.path", str(vllm_untied), "--model.finetuning", adapter, "--teacher.path", str(teacher)),
        *("--data.train", f"[{prompts}]", "--data.eval", "[]", "--output_dir", str(tmp_path / "out")),
        *("--train.max_steps", "2", "--train.batch_size", "2", "--train.seq_length", "64"),
        *("--train.learning_rate", "1e-2", "--train.eval_steps", "0", "--checkpoint.save_interval", "1000h"),
        *("--distill.lmbda", "1", "--generation.backend", "vllm", "--generation.max_new_tokens", "6"),
        *("--generation.temperature", "0.7"),
        *("--lora.r", "4"),  # within the shared server's max_lora_rank (a stage's own server is started for its rank)
    ]
    rollouts, real = [], DistillStage.rollout
    monkeypatch.setattr(
        DistillStage, "rollout", lambda self, *a, **k: rollouts.append(real(self, *a, **k)) or rollouts[-1]
    )
    states = PolicyStates(vllm_untied)
    make = on_server(shared_server, vllm_untied, tmp_path / "v")
    factory = states.factory(lambda policy: make(policy, max_new_tokens=6, temperature=0.7))
    stage = run_stage(DistillStage, argv, on_step=lambda st, m: states.capture(), generator_factory=factory)
    steps = stage.history.steps
    assert [s["distill/on_policy"] for s in steps] == [1.0, 1.0] and len(rollouts) == 2 and states.moved()
    gaps = [states.engine_gap(k, rollout, 0.7) for k, rollout in enumerate(rollouts)]
    logged = [s["rollout/logprob_diff_max"] for s in steps]
    print(f"distill {adapter}: engine vs the student max {gaps}, logged {logged}")
    assert max(gaps) < 1e-3  # the engine sampled the student as it was at each rollout
    assert states.engine_gap(0, rollouts[1], 0.7) > 1e-3  # the first student does not explain step 2's draws
    assert steps[0]["train/loss"] > 0 and steps[1]["train/loss"] != steps[0]["train/loss"]
    for step, gap in zip(steps, gaps):
        assert step["rollout/logprob_diff_mean"] <= step["rollout/logprob_diff_max"]
        if adapter == "qlora":  # the trainer scores with the 4-bit base, the engine samples the unquantized one
            assert step["rollout/logprob_diff_max"] > 10 * max(gap, 1e-6)
        else:  # the same weights in fp32 on both sides
            assert step["rollout/logprob_diff_max"] < 1e-4
    assert states.engine_gap(0, rollouts[0], 1.0) > 1e-2  # ...which at another temperature would part


def test_vllm_generator_follows_a_full_fine_tuned_policy(vllm_untied, vllm_tiny, shared_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modeling.vllm_server import VLLMError
    from pipeline.rl.rollout import cut_at_eos
    from pipeline.rl.vllm_generator import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(vllm_untied)
    eos = [tok.eos_token_id]
    tied = AutoModelForCausalLM.from_pretrained(vllm_tiny, dtype=torch.float32)
    with pytest.raises(VLLMError, match="tied input/output embeddings"):  # refused before any server starts
        VLLMGenerator(tied, str(vllm_tiny), tmp_path / "tied", tok.pad_token_id, eos, max_new_tokens=4).start()
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(vllm_untied, dtype=torch.float32)
    prompts = [tok("Tell me a story about a cat.")["input_ids"], tok("Hi there")["input_ids"]]
    target = torch.tensor([prompts[0] + tok(" the cat sat on the mat")["input_ids"]])
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    gen = VLLMGenerator(
        policy,
        str(vllm_untied),
        tmp_path / "vllm",
        tok.pad_token_id,
        eos,
        max_new_tokens=12,
        max_num_seqs=4,
        server=shared_server,
    )
    try:
        before = trainer_greedy(policy, prompts, 12, eos)
        for k in (2, 1):
            for _ in range(k):
                policy(input_ids=target, labels=target).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            want = trainer_greedy(policy, prompts, 12, eos)
            assert [cut_at_eos(ids, eos)[0] for ids in gen.generate(prompts, temperature=0.0)] == want
        assert want != before
    finally:
        gen.close()


# ------------------------------------------------------------------------------------------
# the gold table --backend vllm, relay chat --backend vllm (on the shared server: its start is tested above)
# ------------------------------------------------------------------------------------------


def test_gold_table_and_chat_on_vllm_answer_as_the_relay_backend(
    vllm_untied, shared_server, tmp_path, monkeypatch, capsys
):
    """On the untied model (the tied tiny one only repeats the prompt's last newline)."""
    from pipeline.modeling import vllm_server
    from pipeline.tools import chat as chat_tool
    from pipeline.tools.gold import GoldSettings, gold_row

    gold = tmp_path / "gold.jsonl"
    gold.write_text(
        "".join(
            (Path(__file__).parents[1] / "data" / "sample" / "gold" / "eval.jsonl")
            .read_text()
            .splitlines(keepends=True)[:6]
        )
    )
    started = []

    class Borrowed:  # the gold backend's server, served by the module's one on the same folder
        def __init__(self, folder, opts):
            started.append((folder, opts))

        def __enter__(self):
            return shared_server

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(vllm_server, "VLLMServer", Borrowed)
    rows = {
        backend: gold_row(
            backend,
            str(vllm_untied),
            gold,
            GoldSettings(max_new_tokens=12, batch_size=3, backend=backend),
            answers_dir=tmp_path / "answers",
        )
        for backend in ("relay", "vllm")
    }
    assert [(f, o.dtype, o.max_num_seqs) for f, o in started] == [(str(vllm_untied), "float32", 3)]
    read = lambda name: [
        json.loads(line)["answer"] for line in (tmp_path / "answers" / f"{name}.jsonl").read_text().splitlines()
    ]  # noqa: E731
    assert read("vllm") == read("relay") and any(read("relay"))
    assert {k: rows["vllm"][k] for k in ("phrase_rate", "fact_accuracy", "n")} == {
        k: rows["relay"][k] for k in ("phrase_rate", "fact_accuracy", "n")
    }

    relay = chat_tool.load_chat_model(str(vllm_untied))
    served = chat_tool.ChatModel(
        "vllm",
        None,
        relay.tokenizer,
        server=shared_server,
        eos_ids=chat_tool.chat_eos_ids(str(vllm_untied), relay.tokenizer),
    )
    for text in ("Tell me a story about a cat.", "What is the capital of France?"):
        messages = [{"role": "user", "content": text}]
        gen = chat_tool.Generation(max_new_tokens=10)
        assert chat_tool.reply(served, messages, gen) == chat_tool.reply(relay, messages, gen)
        assert served.last_answer_cut == relay.last_answer_cut
    assert chat_tool.main(["--model", str(vllm_untied), "--backend", "vllm", "--top-k", "5", "--prompt", "hi"]) == 2
    assert "--backend vllm samples with temperature and top-p only" in capsys.readouterr().err


def test_vllms_hermes_parser_reads_relays_layout_on_smollm2(embedded_path):
    """SmolLM2's tokenizer has no single <tool_call> token (it is several ids): vLLM's hermes
    parser, which `relay serve --backend vllm` starts vLLM with, still reads the calls Relay's
    layout writes (content, two calls, a non-ASCII argument), whole and streamed token by token,
    as Relay's own reader (`parse_answer`) reads them."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from data_formats.conversation import Conversation, Turn
    from data_formats.render import make_template, render_segments
    from data_formats.tools import parse_answer
    from pipeline.config import ChatDataConfig

    tok = AutoTokenizer.from_pretrained(embedded_path)
    template = make_template(ChatDataConfig(), tok)
    calls = [
        {"name": "add", "arguments": {"a": 48213, "b": 91877}},
        {"name": "lookup", "arguments": {"city": "Zürich", "n": [1, 2]}},
    ]
    conv = Conversation(
        [Turn("user", "u"), Turn("assistant", "Let me check.", tool_calls=calls), Turn("tool", "1"), Turn("tool", "2")],
        tools=[
            {"name": n, "description": "d", "parameters": {"type": "object", "properties": {}}}
            for n in ("add", "lookup")
        ],
    )
    text = next(t for t, trained in render_segments(conv, tok, template) if trained).removesuffix(template.eos)
    ours = parse_answer(text)
    assert ours.calls == calls and not ours.errors
    script = Path(__file__).parent / "vllm_side" / "hermes_read.py"
    done = subprocess.run(
        [vllm_python(), str(script), str(embedded_path), text],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(read["opener_ids"]) > 1  # no single <tool_call> token
    whole, streamed = read["whole"], read["streamed"]
    assert whole["called"] and [(n, json.loads(a)) for n, a in whole["calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed["calls"].items())] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert whole["content"].strip() == streamed["content"].strip() == ours.content.strip() == "Let me check."


# ------------------------------------------------------------------------------------------
# A served distillation teacher (stages/distill.py, teacher.backend vllm) on the shared server
# ------------------------------------------------------------------------------------------


def test_served_top_k_prompt_logprobs_equal_transformers(vllm_untied, shared_server):
    """Each position's top-k prompt log-probs from the server equal transformers' log-softmax of the
    same model's logits (same ids, log-probs within 1e-4), and the tail bucket built from them
    equals the in-process top-k form's (pipeline/algorithms/distill.py)."""
    from transformers import AutoModelForCausalLM

    from pipeline.algorithms import distill as dl
    from pipeline.modeling.vllm_server import prompt_topk

    k = 8
    sequences = [[1, 17, 300, 42, 9, 2048, 5, 77], [400, 12, 3]]
    scored = prompt_topk(shared_server, sequences, k)
    model = AutoModelForCausalLM.from_pretrained(vllm_untied, dtype=torch.float32)
    for ids, served in zip(sequences, scored):
        assert len(served) == len(ids) and served[0] is None
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        want_ids, want_logp, want_tail = dl.teacher_topk(logits, k, 1.0)
        got_ids, got_logp, got_tail = dl.served_topk(served[1:], k)
        assert torch.equal(got_ids, want_ids)
        assert torch.allclose(got_logp, want_logp, atol=1e-4, rtol=0), (got_logp - want_logp).abs().max()
        assert torch.allclose(got_tail.exp(), want_tail.exp(), atol=1e-4, rtol=0)


def test_distill_with_a_served_teacher_equals_the_in_process_teacher(vllm_tiny, vllm_untied, shared_server, tmp_path):
    """Two steps of the distill stage (top-k 8 with its tail bucket, LoRA, the same scripted
    samples): the teacher's top-k from the server gives the in-process teacher's losses and
    gradients. The teacher is a sharper model of vllm_untied's shape, loaded into the shared
    server (a near-uniform one puts almost all its mass in the tail, where the loss is ~0). The
    logged KL of a served teacher is over its top-k support plus the tail, so it is at most the
    in-process teacher's whole-vocabulary KL (the coarser support loses divergence, never adds)."""
    from distrun import ScriptedGenerator
    from stagerun import fresh_accelerate, run_stage

    from stages.distill import DistillStage

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}" + "!" * i}) + "\n" for i in range(4)))
    teacher = make_tiny_model(
        tmp_path / "teacher",
        seed=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        initializer_range=0.6,
    )
    shared_server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(teacher)}})
    shared_server.post("/reset_prefix_cache", {})
    runs = {}
    for backend in ("relay", "vllm"):
        fresh_accelerate()
        argv = [
            "--model.path",
            str(vllm_tiny),
            "--teacher.path",
            str(teacher),
            "--teacher.top_k",
            "8",
            "--teacher.backend",
            backend,
            "--data.train",
            f"[{prompts}]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(tmp_path / backend),
            "--train.max_steps",
            "2",
            "--train.batch_size",
            "2",
            "--train.seq_length",
            "64",
            "--generation.max_new_tokens",
            "6",
            "--train.learning_rate",
            "5e-3",
            "--train.precision",
            "fp32",
            "--train.log_steps",
            "1",
            "--train.eval_steps",
            "0",
            "--checkpoint.save_interval",
            "1000h",
        ]
        stage = run_stage(
            DistillStage, argv, generator_factory=lambda policy: ScriptedGenerator(), teacher_server=shared_server
        )
        runs[backend] = stage.history.steps
    for key in ("train/loss", "train/grad_norm"):
        got, want = [s[key] for s in runs["vllm"]], [s[key] for s in runs["relay"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), key
    assert runs["relay"][0]["train/loss"] > 0.01 and runs["relay"][1]["train/loss"] != runs["relay"][0]["train/loss"]
    assert all(v["distill/kl"] <= r["distill/kl"] + 1e-6 for v, r in zip(runs["vllm"], runs["relay"]))


# ------------------------------------------------------------------------------------------
# GRPO and PPO with tools on the vllm backend, on the engine server with an EOS-prone base
# ------------------------------------------------------------------------------------------
# Two steps of each stage, the policy a tiny model whose turns end often, its ended turns read as
# calls to `add` (a random model writes none), LoRA and full weights, every correction, asserting
# what a tool rollout owes on an engine:
# - results were inserted and later turns asked for (in the run: step 1's draws are fixed by the seed,
#   step 2's by the update, which may leave no turn ended within the budget);
# - every request asks for the row's remaining budget (the response budget less the turns and
#   results before it), capped by the room under the server's max_model_len, and gets no more;
# - the engine's log-prob of every sampled token of every turn is recorded at its position (the
#   trainer's agree within fp32 noise, which a shifted position would not), NaN on inserted tokens;
# - the mismatch correction weighs each sampled token's loss by its definition of the trainer's and
#   engine's log-probs, 1 on inserted ones, exactly as for a single-answer rollout (`check_correction`);
# - rollout/logprob_diff_mean/_max are logged.

CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
QUESTIONS = [f"What is 2 + {i}?" for i in range(4)]


@pytest.fixture(scope="module")
def caller(vllm_untied, tmp_path_factory):
    """vllm_untied made to end its turns often (tests/tinymodels.py `make_eos_prone`: about 1 token
    in 5 is the end-of-turn token at T 0.8 after the questions' prompts), so turns end at different
    lengths and rows take several turns. The engine and the trainer compute the same (Llama, untied
    head)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_untied)
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chat]
    return make_eos_prone(vllm_untied, tmp_path_factory.mktemp("vllm-tools") / "caller", prompts, temperature=0.8)


@pytest.fixture
def calls(monkeypatch):
    """Inside the stages' tool rollouts, an ended turn reads as a call to add(2, 3), except every
    third one read, which is an answer (a random model writes no call; the engine still samples
    every token). Validation's layout check reads with the real reader."""
    import itertools

    from data_formats.tools import ParsedAnswer
    from pipeline.rl import policy_stage as policy
    from pipeline.rl import tool_rollout as module

    read, real = itertools.count(), module.tool_rollout

    def reading(text):
        return ParsedAnswer("", [CALL] if next(read) % 3 != 2 else [], [])

    def rollout(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(module, "parse_answer", reading)
            return real(*args, **kwargs)

    monkeypatch.setattr(policy, "tool_rollout", rollout)


@pytest.fixture
def tools_server(engine_server, caller):
    """`engine_server` with `caller`'s weights as its base (the stages' policies are LoRAs on it)."""
    engine_server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(caller)}})
    engine_server.post("/reset_prefix_cache", {})
    return engine_server


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-tools") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": "5"}) + "\n" for q in QUESTIONS))
    return path


def recorded(monkeypatch) -> list[tuple[list[int], int, list[int]]]:
    """Every request a `VLLMGenerator` sends from now on: (prompt ids, max_tokens, the ids it got)."""
    from pipeline.rl.vllm_generator import VLLMGenerator

    seen, real = [], VLLMGenerator.request

    def request(self, model, prompt, *args, **kwargs):
        ids, values = real(self, model, prompt, *args, **kwargs)
        seen.append((list(prompt), kwargs.get("max_tokens", self.max_new_tokens), ids))
        return ids, values

    monkeypatch.setattr(VLLMGenerator, "request", request)
    return seen


def factory(server, folder, workdir, cfg):
    """The stage's sampler on the shared `server` (as `make_generator` builds it for backend vllm)."""
    from transformers import AutoTokenizer

    from pipeline.rl.vllm_generator import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(folder)
    gen = cfg.generation
    return lambda policy: VLLMGenerator(
        policy,
        str(folder),
        workdir,
        tok.pad_token_id,
        [tok.eos_token_id],
        gen.max_new_tokens,
        gen.temperature,
        max_model_len=cfg.train.seq_length,
        server=server,
    )


def check_step(rollout, requests, figures, old, weight, cfg, max_model_len, expected=None) -> tuple[int, int, int, int]:
    """What one step of a tool rollout on vLLM owes (the comment above); returns (tokens the correction dropped,
    tokens it kept, rows with an inserted result, requests for a later turn), for `check_steps`. `expected`: the
    log-probs the engine owes where they are not the trainer's `old` (QLoRA: the unquantized base's, `PolicyStates`)."""
    budget = cfg.generation.max_new_tokens
    mask = rollout.response_mask.bool()
    inside = rollout.attention_mask[:, rollout.prompt_width :].bool()
    inserted = inside & ~mask
    called = int(inserted.any(1).sum())  # ended turns were calls: results were inserted
    results = sum(m["role"] == "tool" and m["content"] == "5" for conv in rollout.conversations for m in conv)
    assert (results > 0) == (called > 0), rollout.conversations
    # budgets: each request is one row's turn; its context is that row's prompt and its tokens so far
    rows = [rollout.input_ids[r][rollout.attention_mask[r].bool()].tolist() for r in range(len(rollout.responses))]
    starts = [len(row) - len(resp) for row, resp in zip(rows, rollout.responses)]
    later = 0
    for prompt, max_tokens, got in requests:
        r = next(r for r, row in enumerate(rows) if row[: len(prompt)] == prompt and len(prompt) >= starts[r])
        used = len(prompt) - starts[r]
        assert max_tokens == min(budget - used, budget, max_model_len - len(prompt)) and len(got) <= max_tokens
        later += used > 0  # a later turn, asked for what its row had left
    # the engine's log-probs: every sampled token's, NaN on the inserted ones, at the trainer's (or `expected`)
    # within fp32 noise
    engine = rollout.engine_logp
    assert engine is not None and not engine[mask].isnan().any() and engine[inserted].isnan().all()
    gap = ((old if expected is None else expected) - engine)[mask].abs()
    assert gap.max() < 1e-3 and gap.mean() < 1e-4, (gap.max(), gap.mean())
    delta = (old - engine)[mask].abs()
    assert figures["rollout/logprob_diff_max"] == pytest.approx(float(delta.max()), rel=1e-5, abs=1e-9)
    # the correction, on the sampled tokens only: (tokens dropped, kept)
    return (*check_correction(cfg.generation, old, engine, mask, weight), called, later)


def check_steps(gen, results: list[tuple[int, int, int, int]]) -> None:
    """Over the run: results were inserted and later turns asked for, and the correction dropped what it owes."""
    called, later = (sum(column) for column in list(zip(*results))[2:])
    assert called >= 1 and later >= 1, results
    check_dropped(gen, [r[:2] for r in results])


def two_recorded_steps(stage_class, cfg, take, requests: list, generator_factory):
    """Run a two-step tool stage on the tools server; per step: (figures, `take(stage)`, the requests
    the engine got during that step). Prints each step's request count and log-prob mismatch."""
    from stagerun import run_stage

    seen = {}

    def on_step(stage, figures):
        seen[stage.step] = (figures, take(stage), list(requests))
        requests.clear()

    stage = run_stage(stage_class, cfg, on_step=on_step, generator_factory=generator_factory)
    assert stage.final_summary["steps"] == 2 and sorted(seen) == [1, 2]
    for step, (figures, _, asked) in seen.items():
        print(
            f"{stage.name} step {step}: {len(asked)} requests, max_tokens {sorted({m for _, m, _ in asked})}, "
            f"logprob diff mean {figures['rollout/logprob_diff_mean']:.2e} "
            f"max {figures['rollout/logprob_diff_max']:.2e}"
        )
    return stage, seen


@pytest.mark.parametrize("adapter, correction", TOOLED)
def test_grpo_with_tools_on_vllm(adapter, correction, caller, tools_server, questions, calls, tmp_path, monkeypatch):
    from test_tool_rollout import _grpo_cfg

    from pipeline.tools.report import read_scalars
    from stages import grpo

    cfg = _grpo_cfg(tmp_path / "out", caller, questions, backend="vllm")
    cfg.train.max_steps, cfg.train.seq_length, cfg.model.finetuning = 2, 512, adapter
    cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.tools.max_turns = 48, 0.8, 3
    cfg.tracking.trackers = ["tensorboard"]
    assert cfg.generation.correction == "auto" and cfg.generation.correction_name == "tis"
    set_correction(cfg, correction, monkeypatch)
    requests = recorded(monkeypatch)
    updates, weights = spy_grpo(monkeypatch)
    states = PolicyStates(caller)
    take = lambda st: (states.capture(), st.last_rollout["rollout"])[1]  # noqa: E731
    _, seen = two_recorded_steps(
        grpo.GRPOStage, cfg, take, requests, states.factory(factory(tools_server, caller, tmp_path / "v", cfg))
    )
    counts = []
    for step, (figures, rollout, asked) in seen.items():
        scored = updates[step - 1][1]
        expected = states.logprobs(step - 1, rollout, cfg.generation.temperature) if adapter == "qlora" else None
        counts.append(
            check_step(
                rollout,
                asked,
                figures,
                scored["old"],
                scored.get("is_weight"),
                cfg,
                tools_server.opts.max_model_len,
                expected,
            )
        )
    check_steps(cfg.generation, counts)
    assert weights and all((w is None) == (correction == "none") for w in weights)  # every policy-loss call
    scalars = read_scalars(tmp_path / "out")
    assert [s for s, _ in scalars["rollout/logprob_diff_mean"]] == [1, 2] and [
        s for s, _ in scalars["rollout/logprob_diff_max"]
    ] == [1, 2]


@pytest.mark.parametrize("adapter, correction", TOOLED)
def test_ppo_with_tools_on_vllm(
    adapter, correction, caller, tiny_reward_dir, tools_server, questions, calls, tmp_path, monkeypatch
):
    from test_ppo import make_cfg

    from pipeline.rl import ppo as algo
    from stages import ppo

    cfg = make_cfg(
        tmp_path / "out",
        caller,
        tiny_reward_dir,
        questions,
        max_steps=2,
        batch_size=2,
        learning_rate=1e-3,
        seq_length=512,
    )
    cfg.generation.backend, cfg.generation.max_new_tokens, cfg.generation.temperature = "vllm", 48, 0.8
    cfg.tools.funcs, cfg.tools.max_turns, cfg.model.finetuning = ["test_tool_rollout:add"], 3, adapter
    assert cfg.generation.correction_name == "tis"
    set_correction(cfg, correction, monkeypatch)
    requests = recorded(monkeypatch)
    weights, real_loss = [], algo.policy_loss
    monkeypatch.setattr(
        algo, "policy_loss", lambda *a, weight=None, **k: weights.append(weight) or real_loss(*a, weight=weight, **k)
    )
    states = PolicyStates(caller)
    take = lambda st: (states.capture(), st.last_experience)[1]  # noqa: E731
    stage, seen = two_recorded_steps(
        ppo.PPOStage, cfg, take, requests, states.factory(factory(tools_server, caller, tmp_path / "v", cfg))
    )
    counts = []
    for step, (figures, exp, asked) in seen.items():
        rollout = exp.rollout
        expected = states.logprobs(step - 1, rollout, cfg.generation.temperature) if adapter == "qlora" else None
        counts.append(
            check_step(
                rollout, asked, figures, exp.old_logprobs, exp.is_weight, cfg, tools_server.opts.max_model_len, expected
            )
        )
        assert (exp.advantages[exp.rollout.response_mask == 0] == 0).all()
    check_steps(cfg.generation, counts)
    assert weights and all((w is None) == (correction == "none") for w in weights)
    assert stage._generator is None and tools_server.proc.poll() is None  # released, the shared server left running
