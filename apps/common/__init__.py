"""What the apps (``apps.grpo``, ``apps.sft``, ``apps.eval``, ``apps.multi_lora``) share: the command
line and exit codes (``cli``), the config sections and the root configs' base (``config``), starting
and stopping roles (``launch``), the model and data made ready (``inputs``), the per-step log,
checkpoints to resume, the held-out evaluation's settings and the weight sync."""
