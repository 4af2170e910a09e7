"""MoE routing tools for the trainer: Routing Replay (R2 / R3) and expert-drift instrumentation."""
