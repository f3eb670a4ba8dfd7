"""Likely mistakes, said before a run starts: one line each, never an error (the run may mean it).

    for line in config_warnings(cfg): print(f"warning: {line}")       # `plan` and `train`
    for line in data_warnings(cfg, data, world_size, resumed_dataset): ...  # `train`, with the data open

`config_warnings` needs only the config; `data_warnings` compares it with the prepared data (and,
on resume, with the data the checkpoint was trained on).
"""

from __future__ import annotations

from pretrainer.config.schema import Config


def config_warnings(cfg: Config) -> list[str]:
    t, o, s = cfg.train, cfg.optim, cfg.spike
    steps = t.max_steps  # the run's length (train.stop_at_step only ends this launch early)
    warnings = []
    if o.warmup_steps > steps:
        warnings.append(
            f"optim.warmup_steps = {o.warmup_steps} > train.max_steps = {steps}: the LR never reaches "
            f"optim.lr = {o.lr:g} (it ends at {o.lr * steps / o.warmup_steps:.3g}); lower the warmup"
        )
    elif o.warmup_steps == steps:
        warnings.append(
            f"optim.warmup_steps = train.max_steps = {steps}: the LR reaches optim.lr = {o.lr:g} only at the "
            f"last step and never decays; lower the warmup"
        )
    if cfg.eval.every > steps:
        warnings.append(
            f"eval.every = {cfg.eval.every} is longer than the run ({steps} steps): validation runs only at "
            f"the start and the end"
        )
    if cfg.ckpt.every > steps:
        warnings.append(
            f"ckpt.every = {cfg.ckpt.every} is longer than the run ({steps} steps): the only checkpoint is "
            f"the final one, so an interruption loses the whole run"
        )
    if cfg.log.every > steps:
        warnings.append(
            f"log.every = {cfg.log.every} is longer than the run ({steps} steps): only the last step is "
            f"logged"
        )
    if steps <= s.min_values:
        warnings.append(
            f"the spike detector starts after spike.min_values = {s.min_values} steps and this run has "
            f"{steps}: "
            f"no loss or grad-norm spike can be flagged (non-finite values still are)"
        )
    return warnings


def data_warnings(cfg: Config, data, world_size: int, resumed: dict | None = None) -> list[str]:
    """`data`: an open DataDir (pretrainer.data.loader); `resumed`: the checkpoint's state.json, when
    resuming (its "dataset" record and tokens per step)."""
    t, seq_len = cfg.train, cfg.model.seq_len
    warnings = []
    train_sequences = (data.manifest["splits"]["train"]["tokens"] - 1) // seq_len
    val_sequences = (data.manifest["splits"]["val"]["tokens"] - 1) // seq_len
    per_step = t.micro_batch * t.grad_accum * world_size
    epochs = t.max_steps * per_step / max(train_sequences, 1)
    if epochs > 1:
        warnings.append(
            f"the run reads {t.max_steps * per_step:,} sequences of {seq_len}, {epochs:.1f} epochs of the "
            f"train split's {train_sequences:,}: the model sees the same data again (more data, or fewer "
            f"steps)"
        )
    wanted_val = cfg.eval.batches * t.micro_batch
    if 0 < val_sequences < wanted_val:
        warnings.append(
            f"the val split has {val_sequences:,} sequences of {seq_len}, fewer than eval.batches x "
            f"train.micro_batch = {wanted_val}: each validation uses {val_sequences} (a noisier estimate)"
        )
    resumed_dataset = resumed.get("dataset") if resumed else None
    step_tokens = per_step * seq_len
    if resumed and resumed.get("tokens_per_step", step_tokens) != step_tokens:
        warnings.append(
            f"tokens per step change from {resumed['tokens_per_step']:,} at the checkpoint (world size "
            f"{resumed.get('world_size')}) to {step_tokens:,} ({t.micro_batch} x {seq_len} x {t.grad_accum} "
            f"x {world_size} "
            f"ranks): set train.global_batch to keep the batch when the world size changes"
        )
    # the tokenizer's and the splits' sha256 (the manifest also holds its creation time)
    if resumed_dataset is not None:
        now = data.provenance()
        changed = [
            name for name in ("tokenizer", "splits", "mixture") if resumed_dataset.get(name) != now.get(name)
        ]
        if changed:
            warnings.append(
                f"{data.path}/manifest.json: the data changed since the checkpoint (its "
                f"{' and '.join(changed)} "
                f"differ from those of {resumed_dataset.get('dir')}): the resumed run continues on other data"
            )
    return warnings
