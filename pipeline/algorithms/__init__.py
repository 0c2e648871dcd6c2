"""Each stage's math, as small pure functions on tensors with golden tests: SFT's multitask losses
and CoBa (multitask.py), the RM's pairwise loss (pairwise.py), DPO's losses (preference.py), KTO's
(kto.py), PPO's per-token math (rl.py: GAE, the value loss, the KL controllers), GRPO's loss table
(grpo_losses.py) and advantage estimators (advantages.py), the KL estimators (kl.py), the mismatch
corrections (mismatch.py), distillation's divergences (distill.py), and the reward sources (rewards.py,
judge.py). No module here runs a model, a sampler or a stage: the RL runtime that does (generators,
rollouts, the updates, the policy and reference stage bases) is pipeline/rl/. They build on the engine
and the model core, never on a stage."""
