"""The RL runtime, on top of the pure math in pipeline/algorithms/: generation behind one protocol and
its backend registry (generators.py, vllm_generator.py), sampled batches, their log-probs and the
actor-critic (rollout.py), multi-turn tool rollouts (tool_rollout.py), PPO's scoring and update
(ppo.py), GRPO's (grpo.py), and the stage bases the RL and preference stages share: `PolicyStage`
(policy_stage.py: PPO, GRPO, distillation) and `ReferenceStage` (reference_stage.py: DPO, KTO)."""
