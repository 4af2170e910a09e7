"""The RL trainer: ``train(job)`` (``trainer.loop``) runs or resumes a job."""
