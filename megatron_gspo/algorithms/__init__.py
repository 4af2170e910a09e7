"""The RL math as pure functions of tensors: policy losses (GSPO, GSPO-token, GRPO), group
advantages, rollout correction, vocab-parallel log-probs, and where a step's behaviour log-probs
come from (``behaviour.BehaviourPlan``)."""
