"""tests/test_zero_cpu.py's one-process check of `sampling_weights` under DeepSpeed ZeRO-3 (run in a
process of its own: DeepSpeed's process group lives as long as the process). A policy inside a holder
with a head of its own (ActorCritic's shape), partitioned by a ZeRO-3 engine on one CPU rank:

    python tests/zero3_sampling.py MODEL_DIR ZERO3_JSON

prints one line `RESULT {...}`: inside the context the policy's weights are whole and DeepSpeed's
hooks are off, its logits equal the unpartitioned model's; after it (also after an error in the body)
the hooks are back and the weights partitioned again, and a hooked forward still equals; settling
and a gathered rollout run no garbage collection."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from pipeline.engine.engines import HIDDEN_SIZE_AUTOS, _no_shared_memory_op, _world_of_one  # noqa: E402

_no_shared_memory_op()
_world_of_one()

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pipeline.engine.accelerator import sampling_weights, settle_zero3  # noqa: E402


class Holder(torch.nn.Module):
    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy
        self.value = torch.nn.Linear(policy.config.hidden_size, 1)


def hook_counts(hooks) -> tuple[int, int]:
    return len(hooks.forward_hooks), len(hooks.backward_hooks)


def main(model_dir: str, zero3_json: str) -> dict:
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 13, 7]])
    with torch.no_grad():
        want = policy(input_ids=ids).logits
    config = json.loads(Path(zero3_json).read_text())
    hidden = policy.config.hidden_size
    config["zero_optimization"].update({key: size(hidden) for key, size in HIDDEN_SIZE_AUTOS.items()})
    config.update(  # what accelerate fills for one fp32 process
        train_batch_size=1,
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
        bf16={"enabled": False},
        fp16={"enabled": False},
    )
    deepspeed.init_distributed(dist_backend="gloo")
    holder = Holder(policy)
    engine, *_ = deepspeed.initialize(
        model=holder, optimizer=torch.optim.AdamW(holder.parameters(), lr=1e-3), config=config
    )
    hooks = engine.optimizer.parameter_offload
    threshold = config["zero_optimization"]["stage3_param_persistence_threshold"]
    big = [p for p in policy.parameters() if p.ds_numel > threshold]
    before = hook_counts(hooks)
    out = {"partitioned_before": bool(big) and all(p.numel() == 0 for p in big), "hooks_before": before[0] > 0}
    with sampling_weights(engine, policy):
        out["whole"] = all(p.numel() == p.ds_numel for p in policy.parameters())
        out["hooks_off"] = hook_counts(hooks) == (0, 0)
        with torch.no_grad():
            out["gathered_logits_diff"] = float((policy(input_ids=ids).logits - want).abs().max())
    out["hooks_back"] = hook_counts(hooks) == before
    out["partitioned_again"] = all(p.numel() == 0 for p in big)
    try:
        with sampling_weights(engine, policy):
            raise KeyError("the body failed")
    except KeyError:
        pass
    out["hooks_back_after_error"] = hook_counts(hooks) == before
    with torch.no_grad():  # through the hooks again: partitions gathered module by module
        out["hooked_logits_diff"] = float((engine.module.policy(input_ids=ids).logits - want).abs().max())
    collections, real = [], gc.collect
    gc.collect = lambda *args: collections.append(args) or real(*args)
    try:
        settle_zero3(engine)
        with sampling_weights(engine, policy):
            pass
    finally:
        gc.collect = real
    out["gc_passes"] = len(collections)
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])))
