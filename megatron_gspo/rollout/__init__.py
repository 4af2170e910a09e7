"""Rollout: engines that generate samples (token ids, log-probs, routed experts) for the trainer."""
