"""What the console (and train.log) shows for a logged step: one line that reads well in a file."""

from __future__ import annotations

# --- the console ---


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def step_line(record: dict, end_step: int, tokens_per_step: int) -> str:
    """One logged step in one line that reads well in a file: step/total, loss, lr, grad norm, tok/s,
    MFU and $ when known, and the time left at the current speed."""
    parts = [
        f"step {record['step']}/{end_step}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "spent_usd" in record:
        parts.append(f"${record['spent_usd']:,.2f}")
    if record["tokens_per_s"] > 0:
        parts.append(
            f"ETA {format_duration((end_step - record['step']) * tokens_per_step / record['tokens_per_s'])}"
        )
    return " | ".join(parts)
