"""What the apps (``apps.grpo``, ``apps.sft``, ``apps.eval``) share: the command line and exit
codes, the per-step log, the resolved config's record, checkpoints to resume, and the held-out
evaluation's settings."""
