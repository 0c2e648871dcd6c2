"""One stage's algorithm each, as small functions the stages call: SFT's multitask losses and
CoBa (multitask.py), PPO's math (rl.py), its rollouts and actor-critic (rollout.py) and its
experience and update (experience.py). They build on the engine and the model core, never on a
stage."""
