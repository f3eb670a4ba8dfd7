"""A run's bill line by line, as the X1 lab writes its budget table (compute, data preparation, the
persistent disk, a reserve for restarts), plus the work interruptions are expected to throw away, the
total against budget.cap_usd, and the go/no-go price ("do not launch above $1.40/hr").

    bill = cost_lines(cfg.budget, gpus=1, usd_per_gpu_hour=1.10, wall_s=93_600, restart_s=2_100,
                      interruptions_lost_s=0.0)
    bill["total_usd"], bill["go"]
"""

from __future__ import annotations

from pretrainer.config.schema import BudgetConfig, CkptConfig
from pretrainer.train.cadence import AUTO, preemption_cost, young_daly_steps

HOURS_PER_MONTH = 730  # how clouds turn a GB-month price into hours
# a checkpoint's write when none was measured: a local NVMe's order (a network disk is 3-10x slower)
ASSUMED_WRITE_BYTES_PER_S = 1e9
ASSUMED_STARTUP_S = 300.0  # start-up when none was measured: imports, data checks, the first compile


def cost_lines(
    b: BudgetConfig,
    *,
    gpus: int,
    usd_per_gpu_hour: float,
    wall_s: float,
    restart_s: float,
    interruptions_lost_s: float,
) -> dict:
    """Each line's $ and how it was reckoned; the total; the price at which the total reaches
    b.cap_usd; and go (price at most the declared limit, or that break-even price, and the total under
    the cap)."""
    per_hour = gpus * usd_per_gpu_hour  # the instance's price
    hours = wall_s / 3600
    lines = [
        {
            "line": "compute",
            "usd": hours * per_hour,
            "how": f"{gpus} GPU x {hours:,.2f} h x ${usd_per_gpu_hour:g}/GPU-hour",
        }
    ]
    if b.data_prep_hours or b.egress_usd:
        lines.append(
            {
                "line": "data preparation",
                "usd": b.data_prep_hours * per_hour + b.egress_usd,
                "how": f"{b.data_prep_hours:g} h of the instance + ${b.egress_usd:g} download (egress)",
            }
        )
    disk_usd = 0.0
    if b.disk_gb:
        disk_hours = hours + b.data_prep_hours
        disk_usd = b.disk_gb * disk_hours / HOURS_PER_MONTH * b.disk_usd_per_gb_month
        lines.append(
            {
                "line": "persistent disk",
                "usd": disk_usd,
                "how": f"{b.disk_gb:g} GB x {disk_hours:,.1f} h at ${b.disk_usd_per_gb_month:g}/GB-month",
            }
        )
    if b.restarts:
        lines.append(
            {
                "line": "restart reserve",
                "usd": b.restarts * restart_s / 3600 * per_hour,
                "how": f"{b.restarts} x (start-up + one checkpoint interval trained again) = "
                f"{restart_s / 60:,.0f} min each",
            }
        )
    if interruptions_lost_s:
        lines.append(
            {
                "line": "interruptions (expected)",
                "usd": interruptions_lost_s / 3600 * per_hour,
                "how": f"{interruptions_lost_s / 60:,.0f} min of work lost (see checkpointing)",
            }
        )
    total = sum(line["usd"] for line in lines)
    fixed = b.egress_usd + disk_usd  # the lines that do not scale with the GPU price
    usd_per_price = (total - fixed) / usd_per_gpu_hour if usd_per_gpu_hour else 0.0
    break_even = (b.cap_usd - fixed) / usd_per_price if b.cap_usd and usd_per_price else None
    limit = b.max_usd_per_gpu_hour or break_even
    bill = {
        "lines": lines,
        "total_usd": total,
        "cap_usd": b.cap_usd or None,
        "break_even_usd_per_gpu_hour": break_even,
        "max_usd_per_gpu_hour": limit,
        "max_source": "budget.max_usd_per_gpu_hour" if b.max_usd_per_gpu_hour else "break-even at the cap",
    }
    bill["go"] = (limit is None or usd_per_gpu_hour <= limit) and (not b.cap_usd or total <= b.cap_usd)
    return bill


def format_bill(bill: dict, usd_per_gpu_hour: float) -> list[tuple[str, str]]:
    """The bill as plan's (name, value) rows."""
    rows = [(f"  {line['line']}", f"${line['usd']:,.2f}  ({line['how']})") for line in bill["lines"]]
    cap = f" of the ${bill['cap_usd']:,.2f} cap" if bill["cap_usd"] else ""
    rows.append(("  total", f"${bill['total_usd']:,.2f}{cap}"))
    limit = bill["max_usd_per_gpu_hour"]
    if limit is not None:
        price = f"${usd_per_gpu_hour:g}/GPU-hour against a limit of ${limit:,.2f} ({bill['max_source']})"
        if bill["go"]:
            said = f"GO: {price}; do not launch above it"
        elif usd_per_gpu_hour > limit:
            said = f"NO-GO: the price is over the limit: {price}"
        else:  # the price is fine: the cap is why ("NO-GO: $1.1/GPU-hour against a limit of $1.40")
            said = (
                f"NO-GO: the total ${bill['total_usd']:,.2f} is over the ${bill['cap_usd']:,.2f} cap "
                f"(budget.cap_usd); the price is within its limit ({price})"
            )
        rows.append(("go/no-go", said))
    return rows


def checkpoint_plan(
    ckpt: CkptConfig, steps: int, step_s: float, timings: dict | None, state_bytes: int
) -> dict:
    """The run's checkpoint interval in steps (ckpt.every, or auto's Young/Daly choice) and the figures
    behind it, each measured (a probe's or a run's) or assumed."""
    measured = timings or {}
    if measured.get("checkpoint_s"):
        write_s, write_source = measured["checkpoint_s"], "measured"
    else:
        write_s = state_bytes / ASSUMED_WRITE_BYTES_PER_S
        write_source = f"assumed: {state_bytes / 1e9:,.2f} GB at {ASSUMED_WRITE_BYTES_PER_S / 1e9:g} GB/s"
    if measured.get("startup_s") is not None:
        startup_s, startup_source = measured["startup_s"], "measured"
    else:
        startup_s, startup_source = ASSUMED_STARTUP_S, "assumed"
    if ckpt.every == AUTO:
        every = min(steps, young_daly_steps(write_s, step_s, ckpt.interruptions_per_hour))
        every_source = "auto: Young/Daly sqrt(2 x write time x mean time between interruptions)"
    else:
        every, every_source = (
            (ckpt.every or steps),
            "ckpt.every" if ckpt.every else "ckpt.every = 0: the end only",
        )
    plan = {
        "every": every,
        "every_source": every_source,
        "write_s": write_s,
        "write_source": write_source,
        "startup_s": startup_s,
        "startup_source": startup_source,
        "interruptions_per_hour": ckpt.interruptions_per_hour,
    }
    return plan


def with_interruptions(checkpoints: dict, wall_s: float, step_s: float) -> dict:
    """checkpoint_plan's figures plus what the declared interruptions are expected to cost the run."""
    c = checkpoints
    if not c["interruptions_per_hour"]:
        return {**c, "interruptions": 0.0, "lost_s": 0.0}
    lost = preemption_cost(
        wall_s,
        c["every"],
        step_s,
        write_s=c["write_s"],
        startup_s=c["startup_s"],
        per_hour=c["interruptions_per_hour"],
    )
    return {**c, "interruptions": lost["interruptions"], "lost_s": lost["lost_s"]}
