"""vLLM on a CUDA GPU (run_scripts/gpu_check.sh; skipped without CUDA or without vLLM): the engine's
sleep mode frees its GPU memory while the trainer updates and it wakes following the policy, and
the tensor-parallel size reaches the engine (two GPUs). Owed to the first run on a GPU: nothing
here has run yet (no GPU in CI)."""

from __future__ import annotations

import pytest
import torch
from tinymodels import make_tiny_model

from pipeline.modeling.vllm_server import vllm_python

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(vllm_python() is None, reason="vLLM is absent: bash run_scripts/install_vllm.sh"),
]


def gpu_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def lora_policy(folder):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_sleeps_during_the_update_and_wakes_following_the_policy(tmp_path, tp):
    from test_vllm import trainer_greedy
    from transformers import AutoTokenizer

    from pipeline.rl.rollout import cut_at_eos
    from pipeline.rl.vllm_generator import VLLMGenerator

    if torch.cuda.device_count() < tp:
        pytest.skip(f"tensor_parallel_size {tp} needs {tp} GPUs")
    folder = make_tiny_model(tmp_path / "tiny", seed=0, num_attention_heads=2, num_key_value_heads=1)
    tok = AutoTokenizer.from_pretrained(folder)
    eos = [tok.eos_token_id]
    policy = lora_policy(folder)
    prompts = [tok("Tell me a story about a cat.")["input_ids"], tok("Hi there")["input_ids"]]
    target = torch.tensor([prompts[0] + tok(" the cat sat on the mat")["input_ids"]], device="cuda")
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    gen = VLLMGenerator(
        policy,
        str(folder),
        tmp_path / "vllm",
        tok.pad_token_id,
        eos,
        max_new_tokens=12,
        max_num_seqs=4,
        tensor_parallel_size=tp,
        sleep=True,
        gpu_memory_utilization=0.3,
    )
    try:
        gen.start()
        awake = gpu_free()
        for _ in range(2):
            got = [cut_at_eos(ids, eos)[0] for ids in gen.generate(prompts, temperature=0.0)]
            assert got == trainer_greedy(policy, prompts, 12, eos)
            with urlopen_json(gen.server.base_url + "/is_sleeping") as state:
                assert state["is_sleeping"] is True
            # the engine's KV cache (30% of the GPU) and weights are off the GPU during the update
            assert gpu_free() - awake > 0.2 * torch.cuda.get_device_properties(0).total_memory, (gpu_free(), awake)
            policy(input_ids=target, labels=target).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if tp > 1:
            assert "--tensor-parallel-size" in gen.server.proc.args and str(tp) in gen.server.proc.args
    finally:
        gen.close()


class urlopen_json:
    """`with urlopen_json(url) as answer:` the parsed JSON of a GET."""

    def __init__(self, url):
        self.url = url

    def __enter__(self):
        import json
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=30) as response:
            return json.loads(response.read())

    def __exit__(self, *exc):
        return None
