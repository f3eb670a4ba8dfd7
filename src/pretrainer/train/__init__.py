"""The training loop and what it needs: optimizer, schedules, checkpoints."""
