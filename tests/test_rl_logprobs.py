"""The RL stages' log-probs and entropies through the chunked LM head (no [B, R, V] logits) equal
the full-logits path: values, the gradients with respect to the hidden states, the head's weight
and the backbone (LoRA adapters included), at temperatures 1 and 0.7, on ragged rollouts."""

from __future__ import annotations

import pytest
import torch

from pipeline.algorithms import rl
from pipeline.engine import supervised_head
from pipeline.rl import rollout as ro

TOL = 1e-6
"""Of the largest entry of the tensor compared (1e-6 absolute where that is below 1): fp32 rounding.
The chunks multiply by the head in products of another shape than the full path's, so a logit may
differ in its last bit, and a gradient summed over rows in another order."""


def _close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.shape == want.shape, what
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= TOL * scale, f"{what}: max |difference| {err:.3g} > {TOL:g} x {scale:.3g}"


def _tiny(vocab: int = 97, tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: peaked and flat rows both
    return model


def _ragged_rollout(vocab: int, seed: int = 1, shared_prompt: bool = False):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (5,), generator=g).tolist()
    prompts = [prompt if shared_prompt else torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (7, 2, 11, 5)]
    return ro.assemble(prompts, responses, pad_id=0, eos_ids=[-1])


def _full(model, r, temperature):
    logits = ro.policy_logits(model, r.input_ids, r.attention_mask, r.prompt_width).float() / temperature
    return rl.logprobs_from_logits(logits, r.response_ids), rl.entropy_from_logits(logits.detach())


def _grads(model, value: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (value * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logps_equal_log_softmax_with_gradients(temperature, monkeypatch):
    """Hidden rows through the chunked head (several chunks, a ragged last one) against
    log_softmax(head(hidden) / T): log-probs, entropies and the gradients with respect to the
    hidden rows, the head's weight and its bias."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    with torch.no_grad():
        head.weight.mul_(4.0)  # logits of a few units
    hidden = torch.randn(23, 16, requires_grad=True)
    tokens = torch.randint(0, 50, (23,))
    upstream = torch.randn(23)

    logits = head(hidden).float() / temperature
    want = rl.logprobs_from_logits(logits[None], tokens[None])[0]
    want_entropy = rl.entropy_from_logits(logits.detach())
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, head.weight, head.bias))

    monkeypatch.setattr(supervised_head, "chunk_rows", lambda vocab: 5)  # 23 rows: four full chunks and a ragged one
    got, entropy = supervised_head.sampled_token_logps(hidden, head, tokens, temperature, entropy=True)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, head.weight, head.bias))
    _close(got, want)
    _close(entropy, want_entropy)
    assert not entropy.requires_grad
    for g, w in zip(got_grads, want_grads):
        _close(g, w)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_policy_logprobs_equal_the_full_logits_path(temperature, shared_prompt, tie):
    """`policy_logprobs` on a tiny Llama (ragged prompts and responses; a GRPO group's shared
    prompt run once; a head tied to the embeddings or not) against log_softmax of the full
    logits: log-probs, entropies, and every parameter's gradient (head and backbone) of a
    weighted sum of the response tokens' log-probs, in fp32."""
    model = _tiny(tie=tie)
    r = _ragged_rollout(model.config.vocab_size, shared_prompt=shared_prompt)
    weights = torch.randn(r.response_mask.shape, generator=torch.Generator().manual_seed(2)) * r.response_mask

    want, want_entropy = _full(model, r, temperature)
    want_grads = _grads(model, want, weights)
    assert supervised_head.head_split(model) is model.lm_head  # the chunked path is the one under test
    got = ro.policy_logprobs(model, r.input_ids, r.attention_mask, r.prompt_width, temperature, entropy=True)
    got_grads = _grads(model, got.logp, weights)

    mask = r.response_mask.bool()
    _close(got.logp[mask], want[mask])
    _close(got.entropy[mask], want_entropy[mask])
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads or tie
    for name, grad in want_grads.items():
        _close(got_grads[name], grad, name)


def test_policy_logprobs_through_a_lora_policy_and_its_reference():
    """A LoRA'd policy (adapters on the attention and MLP projections, the plain head chunked)
    and its adapter-disabled reference (`ActorCritic.reference_logprobs`): log-probs and the
    adapters' gradients equal the full-logits path."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _tiny(),
        LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj", "up_proj"]
        ),
    )
    r = _ragged_rollout(97)
    weights = torch.randn(r.response_mask.shape, generator=torch.Generator().manual_seed(3)) * r.response_mask
    want, _ = _full(model, r, 0.7)
    want_grads = _grads(model, want, weights)
    got = ro.policy_logprobs(model, r.input_ids, r.attention_mask, r.prompt_width, 0.7)
    got_grads = _grads(model, got.logp, weights)
    assert got.entropy is None and any("lora_" in n for n in got_grads)
    mask = r.response_mask.bool()
    _close(got.logp[mask], want[mask])
    for name, grad in want_grads.items():
        _close(got_grads[name], grad, name)

    pair = ro.ActorCritic(model, model)
    from pipeline.modeling.models import adapter_disabled

    with torch.no_grad(), adapter_disabled(model):
        ref_want, _ = _full(model, r, 0.7)
    _close(
        pair.reference_logprobs(r.input_ids, r.attention_mask, r.prompt_width, 0.7)[mask], ref_want[mask], "reference"
    )


def test_a_lora_head_takes_the_full_logits_path_with_the_same_numbers():
    """A head with its own adapter is not a plain Linear: `policy_logprobs` runs the full logits
    (the adapter's delta is part of them) and its log-probs and the head adapter's gradient are
    those of that path."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _tiny(),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "lm_head"]),
    )
    assert supervised_head.head_split(model) is None
    r = _ragged_rollout(97)
    weights = torch.randn(r.response_mask.shape, generator=torch.Generator().manual_seed(4)) * r.response_mask
    want, want_entropy = _full(model, r, 1.0)
    want_grads = _grads(model, want, weights)
    got = ro.policy_logprobs(model, r.input_ids, r.attention_mask, r.prompt_width, 1.0, entropy=True)
    got_grads = _grads(model, got.logp, weights)
    assert any("lm_head.lora_" in n for n in got_grads)
    torch.testing.assert_close(got.logp, want, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=0, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)


def test_the_rl_forward_never_builds_full_vocabulary_logits(monkeypatch):
    """The GRPO/PPO forward (`ActorCritic(..., temperature=...)`) and its backward allocate no
    tensor with a vocabulary-wide last dimension over more rows than one chunk: at a 4000-token
    vocabulary with chunks of 3 rows, nothing of 4 x 11 x 4000 floats (or 44 x 4000) appears."""
    model = _tiny(vocab=4000)
    r = _ragged_rollout(4000)
    pair = ro.ActorCritic(model, model)
    monkeypatch.setattr(supervised_head, "chunk_rows", lambda vocab: 3)
    assert supervised_head.head_split(model) is model.lm_head  # its one-time exactness check runs full logits on 1 x 4
    widest = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == 4000:
                    widest.append(t.numel() // 4000)
            return out

    with Watch():
        policy, values = pair(
            r.input_ids, r.attention_mask, r.prompt_width, critic=False, temperature=0.7, entropy=True
        )
        policy.logp.sum().backward()
    assert values is None and policy.entropy is not None
    assert widest and max(widest) <= 3, max(widest)


def test_full_logits_switch_gives_the_same_log_probs():
    """The private switch the memory benchmark's 'before' side uses (`rollout._FULL_LOGITS`) runs
    the old path; its log-probs equal the chunked head's."""
    model = _tiny()
    r = _ragged_rollout(97, shared_prompt=True)
    with torch.no_grad():
        chunked = ro.policy_logprobs(model, r.input_ids, r.attention_mask, r.prompt_width, 0.7).logp
        try:
            ro._FULL_LOGITS = True
            full = ro.policy_logprobs(model, r.input_ids, r.attention_mask, r.prompt_width, 0.7).logp
        finally:
            ro._FULL_LOGITS = False
    mask = r.response_mask.bool()
    _close(chunked[mask], full[mask])
