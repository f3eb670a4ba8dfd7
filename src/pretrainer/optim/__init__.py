"""Optimizers: AdamW's parameter groups, low-bit states, learning-rate schedules, state sizes."""
