"""A batch's shared prompt opening, run once in the scoring and update forwards
(pipeline/modeling/opening.py): the relayout, and every row's logits, values, reward scores and
LoRA gradients against each row run alone, unpadded."""

from types import SimpleNamespace

import pytest
import torch
from tinymodels import make_tiny_model

OPENING = [5, 9, 17, 30, 41, 8, 22, 13, 6, 19, 27, 33, 12, 44, 3, 16, 25, 38, 21, 10]  # 20 tokens, >= SHARED_PREFIX_MIN
PROMPTS = [OPENING + [7, 7, 20], OPENING + [11], OPENING + [34, 18, 29, 40, 15], OPENING + [26, 31]]
RESPONSES = [[3, 4, 5], [6, 2], [8, 9, 10, 11], [4]]


def lora(model, seed: int):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    return model.train()


def shapes_into(model) -> list:
    """The [B, T] of every input the embedding layer sees."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _o: seen.append(tuple(args[0].shape)))
    return seen


def rollout():
    from pipeline.rl.rollout import assemble

    return assemble(PROMPTS, RESPONSES, pad_id=0, eos_ids=[2])


def flat_grad(loss, model) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def test_find_opening_moves_each_rows_padding_after_the_shared_opening(tmp_path):
    from transformers import AutoModelForCausalLM

    from data_formats.collate import shared_first_pad
    from pipeline.modeling.opening import find_opening

    model = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(tmp_path / "tiny", seed=0, vocab_size=48), dtype=torch.float32
    )
    r = rollout()
    P = r.prompt_width
    opening = find_opening(model, r.input_ids, r.attention_mask, P)
    assert opening.shared == len(OPENING)
    ids, mask = shared_first_pad(PROMPTS, 0, len(OPENING))
    assert torch.equal(opening.input_ids[:, :P], ids) and torch.equal(opening.attention_mask[:, :P], mask)
    assert torch.equal(opening.input_ids[:, P:], r.input_ids[:, P:]) and torch.equal(
        opening.attention_mask[:, P:], r.attention_mask[:, P:]
    )
    assert find_opening(model, r.input_ids[:1], r.attention_mask[:1], P) is None  # one row
    holed = r.attention_mask.clone()
    holed[0, P - 2] = 0
    assert find_opening(model, r.input_ids, holed, P) is None  # not left-padded: nothing is moved
    short = [p[len(OPENING) - 10 :] for p in PROMPTS]  # 10 shared tokens
    from pipeline.rl.rollout import assemble

    s = assemble(short, RESPONSES, pad_id=0, eos_ids=[2])
    assert find_opening(model, s.input_ids, s.attention_mask, s.prompt_width) is None
    flash = torch.nn.Module()
    flash.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    assert find_opening(flash, r.input_ids, r.attention_mask, P) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_policy_logits_run_the_opening_once_as_each_row_alone(tmp_path, attn):
    """The opening runs on one row, the rest of the rows on its cache; each row's response logits
    and the batch's LoRA gradients equal those of the rows run one by one without padding."""
    from transformers import AutoModelForCausalLM

    from pipeline.rl.rollout import policy_logits

    folder = make_tiny_model(tmp_path / "tiny", seed=3, initializer_range=0.3, vocab_size=48)
    model = lora(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn), seed=0)
    r = rollout()
    P, T = r.prompt_width, r.input_ids.shape[1]
    seen = shapes_into(model)
    logits = policy_logits(model, r.input_ids, r.attention_mask, P)
    assert seen == [(1, len(OPENING)), (4, T - 1 - len(OPENING))]
    target = lambda out, row: out.log_softmax(-1)[torch.arange(len(RESPONSES[row])), RESPONSES[row]].sum()  # noqa: E731
    got_grad = flat_grad(sum(target(logits[row, : len(RESPONSES[row])], row) for row in range(4)), model)
    want_grad = 0
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        alone = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(
            logits[row, : len(response)].detach(), alone.detach(), atol=1e-5 * float(alone.abs().max()), rtol=0
        )
        want_grad = want_grad + flat_grad(target(alone, row), model)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=0)


def test_critic_values_and_reward_scores_run_the_opening_once_as_each_row_alone(tmp_path, tiny_reward_dir):
    """PPO's critic (LoRA on the reward backbone) and the reward read at the last token, through
    the opening: each row's values at its last prompt token and its response tokens, its reward and
    the critic's LoRA gradients equal those of the row run alone."""
    from transformers import AutoModelForSequenceClassification

    from pipeline.modeling.scoring import token_scores
    from pipeline.rl.rollout import ActorCritic

    critic = lora(AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir, dtype=torch.float32), seed=1)
    pair = ActorCritic(torch.nn.Identity(), critic)
    r = rollout()
    P = r.prompt_width
    seen = shapes_into(critic)
    _, values = pair(r.input_ids, r.attention_mask, P, policy=False)
    assert seen[0] == (1, len(OPENING)) and seen[1][0] == 4
    with torch.no_grad():
        rewards = pair.reward_scores(r.input_ids, r.attention_mask, P)
    got_grad = flat_grad(sum(values[row, : len(RESPONSES[row])].sum() for row in range(4)), critic)
    want_grad = 0
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        ids = torch.tensor([prompt + response])
        alone = token_scores(critic, ids, torch.ones_like(ids))[0]
        torch.testing.assert_close(
            values[row, : len(response)].detach(), alone[len(prompt) - 1 : -1].detach(), atol=1e-5, rtol=0
        )
        with torch.no_grad(), critic.disable_adapter():
            reward = token_scores(critic, ids, torch.ones_like(ids))[0, -1]
        torch.testing.assert_close(rewards[row], reward, atol=1e-5, rtol=0)
        want_grad = want_grad + flat_grad(alone[len(prompt) - 1 : -1].sum(), critic)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=0)
    empty = r.attention_mask.clone()
    empty[1, P:] = 0  # row 1 attends to its prompt only
    with pytest.raises(ValueError, match="no response token"):
        pair.reward_scores(r.input_ids, empty, P)


def test_reward_pairs_run_their_opening_once_as_each_sequence_alone(tiny_reward_dir):
    """The RM's right-padded pairs, in one process: the opening once, then each row on its cache;
    the scores and the LoRA gradients of the pairwise loss equal those of each sequence scored
    alone by the classifier's own forward. Under a wrapping engine the classifier's forward runs."""
    import contextlib

    from accelerate.utils import DistributedType
    from transformers import AutoModelForSequenceClassification

    from data_formats.collate import PairCollator
    from pipeline.algorithms.pairwise import pair_scores, pairwise_loss
    from pipeline.modeling.scoring import sequence_scores

    model = lora(AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir, dtype=torch.float32), seed=2)
    model.config.pad_token_id = 0
    pairs = [
        {"chosen_input_ids": PROMPTS[0] + RESPONSES[0] + [2], "rejected_input_ids": PROMPTS[0] + RESPONSES[1] + [2]},
        {"chosen_input_ids": PROMPTS[2] + RESPONSES[2] + [2], "rejected_input_ids": PROMPTS[2] + [2]},
    ]
    batch = PairCollator(0)(pairs)
    T = batch["input_ids"].shape[1]
    seen = shapes_into(model)
    chosen, rejected = pair_scores(model, batch, None)
    assert seen == [(1, len(OPENING)), (4, T - len(OPENING))]
    got_grad = flat_grad(pairwise_loss(chosen, rejected), model)
    alone = [
        sequence_scores(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))[0]
        for seq in [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
    ]
    torch.testing.assert_close(torch.cat([chosen, rejected]).detach(), torch.stack(alone).detach(), atol=1e-5, rtol=0)
    want_grad = flat_grad(pairwise_loss(torch.stack(alone[:2]), torch.stack(alone[2:])), model)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=0)
    seen.clear()
    wrapped = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, autocast=contextlib.nullcontext)
    pair_scores(model, batch, wrapped)
    assert seen == [(4, T)]
    seen.clear()
    apart = PairCollator(0)(
        [{**pairs[0], "rejected_input_ids": [1] + pairs[0]["rejected_input_ids"]}]
    )  # openings differ
    chosen, rejected = pair_scores(model, apart, None)
    assert seen == [(2, apart["input_ids"].shape[1])]  # the classifier's own forward
    torch.testing.assert_close(chosen[0].detach(), alone[0].detach(), atol=1e-5, rtol=0)


def test_no_opening_on_weights_an_engine_holds_in_shards():
    """FSDP2 units and ZeRO-3 partitions gather their weights for one forward: the opening's cache
    would outlive them. The model layer asks by type what the engine's fsdp.is_sharded asks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pipeline.engine.fsdp import is_sharded
    from pipeline.modeling.opening import held_in_shards, prompt_sharing_allowed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert not held_in_shards(model)
    zero3 = torch.nn.Linear(4, 4)
    zero3.weight.ds_id = 0
    assert held_in_shards(zero3) and not prompt_sharing_allowed(zero3)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model[0])
        fully_shard(model)
        assert held_in_shards(model) and is_sharded(model) and not prompt_sharing_allowed(model)
    finally:
        dist.destroy_process_group()
