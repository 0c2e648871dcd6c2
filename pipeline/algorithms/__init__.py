"""Each stage's math, as small functions the stages call: SFT's multitask losses and CoBa
(multitask.py), the RM's pairwise loss (pairwise.py), DPO's losses (preference.py), PPO's
per-token math (rl.py) and its scoring, experience and update (ppo.py), GRPO's (grpo.py) and its
reward functions (rewards.py); the policy side PPO and GRPO share (rollout.py) and their stage
base (policy.py). They build on the engine and the model core, never on a stage."""
