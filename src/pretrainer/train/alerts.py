"""Alerts that reach a person at 3 a.m.: the budget's warning and stop, a flagged spike, a non-finite
loss, a throughput drop, a stall (no step for alerts.stall_factor x the median step time: a hung
loader or collective), a loss curve heading above the expected loss, and the run's end.

    alerts = Alerts.build(trainer)   # a trainer component; the events the run logs become alerts
    alerts.step_started(step)        # each step: the stall watchdog times it (not the evaluations and
    alerts.step_done(step, loss)     # checkpoints between steps); the curve's points
    alerts.ended(reason, code, step) # the last one; then close()

Each alert is a record in metrics.jsonl ({"step", "alert", "message"}) and a console line; with
alerts.webhook_url (or $PRETRAINER_WEBHOOK_URL) also a JSON POST that Slack ("text") and Discord
("content") incoming webhooks accept, sent by a background thread with a timeout and retries: an
endpoint that hangs or fails never slows or stops training (close() waits at most CLOSE_WAIT_S for
what is queued). The URL is a secret: it is read from the process, never written anywhere.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pretrainer.config.schema import AlertsConfig
from pretrainer.core.end_reasons import BY_NAME
from pretrainer.core.secrets import lost_secret, reveal
from pretrainer.train.component import Component, Step
from pretrainer.train.events import Event

WEBHOOK_ENV = "PRETRAINER_WEBHOOK_URL"
POST_TIMEOUT_S, RETRIES, CLOSE_WAIT_S, REPEAT_S = 5.0, 3, 0.5, 60.0
CURVE_MIN_POINTS, CURVE_FROM = 20, 0.3  # the off-curve forecast needs this many losses and 30% of the horizon
CURVE_EVERY, CURVE_KEEP = 10, 2000  # fit every 10 logged losses, on the newest 2000


class Alerts(Component):
    name = "alerts"

    @classmethod
    def build(cls, trainer) -> Alerts:
        cfg, run_log = trainer.cfg, trainer.run_log
        alerts = cls(
            cfg.alerts,
            trainer.run_dir,
            trainer.env.is_main,
            run_log.write,
            trainer.say,
            max_steps=cfg.train.max_steps,
        )
        run_log.alerts = alerts  # the events the run logs (train/events.py) become alerts
        return alerts

    def before_step(self, step: Step) -> None:
        self.step_started(step.number)  # the stall watchdog times each step (and its drill pauses here)

    def after_log(self, step: Step) -> None:
        self.step_done(step.number, step.record["loss"] if step.record else None)  # the heartbeat

    def __init__(
        self,
        cfg: AlertsConfig,
        run_dir: Path,
        is_main: bool,
        write: Callable[[dict], None],
        say: Callable[[str], None],
        *,
        max_steps: int = 0,
    ):
        self.cfg, self.run_name, self.write, self.say = cfg, Path(run_dir).name, write, say
        self.is_main, self.max_steps = is_main, max_steps
        url = cfg.webhook_url if cfg.webhook_url and not lost_secret(cfg.webhook_url) else ""
        url = reveal(url) or os.environ.get(WEBHOOK_ENV, "")
        if cfg.webhook_url and lost_secret(cfg.webhook_url) and not url and is_main:
            say(
                f"warning: alerts.webhook_url is never saved and this launch was not given it: alerts go to "
                f"metrics.jsonl only (pass --alerts.webhook_url again, or set ${WEBHOOK_ENV})"
            )
        self.sender = WebhookSender(url, say) if url and is_main else None
        self.step, self.last_beat, self.intervals = 0, time.monotonic(), deque(maxlen=64)
        self.stalled, self.off_curve_said, self.losses, self.in_step = False, False, [], False
        self.sent: dict[str, float] = {}  # alert kind -> when it last went to the webhook
        self.stop = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        if is_main:
            self.watchdog.start()

    # --- what the loop calls ---

    def step_started(self, step: int) -> None:
        """A step begins: the watchdog times it from here (an evaluation or checkpoint before it is not a
        stall). The stall drill pauses before alerts.stall_drill_step, as a hung loader would."""
        self.last_beat, self.in_step = time.monotonic(), True
        if self.cfg.stall_drill_step and step == self.cfg.stall_drill_step:
            time.sleep(self.cfg.stall_drill_s)

    def step_done(self, step: int, loss: float | None = None) -> None:
        now = time.monotonic()
        self.intervals.append(now - self.last_beat)
        self.step, self.last_beat, self.stalled, self.in_step = step, now, False, False
        if loss is not None and self.is_main and self.cfg.expected_loss and self.cfg.off_curve_margin:
            self.losses.append((step, loss))
            if len(self.losses) % CURVE_EVERY == 0:  # a fit every few logged steps, on a bounded history
                self.losses = self.losses[-CURVE_KEEP:]
                self._check_curve(step)

    def on_event(self, event: Event) -> None:
        """An event the run logged (train/events.py): its alert, said by its source already."""
        self.alert(event.alert_kind, event.step, event.message(), say=False)

    def ended(self, reason: str, exit_code: int, step: int | None, message: str) -> None:
        """The run's last alert: finished, stopped (on purpose: budget, signal, limit) or died."""
        kind = BY_NAME[reason].alert_kind  # finished, stopped (on purpose) or died
        said = f"{reason} (exit {exit_code})" + (f": {message}" if message else "")
        self.alert(
            kind, step if step is not None else self.step, said, say=False
        )  # the CLI says how it ended

    def alert(self, kind: str, step: int, message: str, say: bool = True) -> None:
        """metrics.jsonl and the console; the webhook too, unless the same kind went out less than
        REPEAT_S ago (ten flagged steps in a row are one ping)."""
        if not self.is_main:
            return
        self.write({"step": step, "alert": kind, "message": message})  # RunLog.write holds a lock
        if say:
            self.say(f"alert: {kind} at step {step}: {message}")
        now = time.monotonic()
        if self.sender is not None and now - self.sent.get(kind, -REPEAT_S) >= REPEAT_S:
            self.sent[kind] = now
            text = f"[pretrainer] {self.run_name}: {kind} at step {step}: {message}"
            payload = {
                "text": text,
                "content": text[:2000],
                "event": kind,
                "step": step,
                "run": self.run_name,
            }
            self.sender.send(payload)

    def close(self) -> None:
        self.stop.set()
        if self.watchdog.is_alive():  # no stall alert after this: metrics.jsonl closes next
            self.watchdog.join(timeout=2)
        if self.sender is not None:
            self.sender.close(CLOSE_WAIT_S)

    # --- the stall watchdog and the loss forecast ---

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.cfg.stall_min_s / 4)):
            if self.stalled or not self.in_step or len(self.intervals) < 3:
                continue
            quiet = time.monotonic() - self.last_beat
            limit = max(self.cfg.stall_min_s, self.cfg.stall_factor * statistics.median(self.intervals))
            if quiet > limit:
                self.stalled = True  # once per stall: the next step re-arms it
                self.alert(
                    "stall",
                    self.step,
                    f"no step for {quiet:,.1f} s (the limit: {limit:,.1f} s, alerts.stall_min_s or "
                    f"{self.cfg.stall_factor:g} x the median step time): a hung data loader or collective?",
                )

    def _check_curve(self, step: int) -> None:
        if self.off_curve_said or not self.max_steps or step < CURVE_FROM * self.max_steps:
            return
        if len(self.losses) < CURVE_MIN_POINTS:
            return
        forecast = forecast_loss(self.losses, self.max_steps)
        if forecast is not None and forecast > self.cfg.expected_loss + self.cfg.off_curve_margin:
            self.off_curve_said = True
            self.alert(
                "off_curve",
                step,
                f"the loss heads for {forecast:.3f} at step {self.max_steps}, above the expected "
                f"{self.cfg.expected_loss:.3f} + {self.cfg.off_curve_margin:g}",
            )


def forecast_loss(points: list[tuple[int, float]], at_step: int) -> float | None:
    """The loss at `at_step` of L(s) = a + b s^-c fitted to the run's own (step, loss) points, the later
    half, c on a grid (least squares for a and b): a curve that flattens, not a straight line."""
    import numpy as np

    steps, losses = (np.array(v, dtype=float) for v in zip(*points[len(points) // 2 :]))
    finite = np.isfinite(losses)
    if finite.sum() < 5:
        return None
    steps, losses = steps[finite], losses[finite]
    best = None
    for c in np.linspace(0.05, 1.5, 30):
        design = np.stack([np.ones_like(steps), steps**-c], axis=1)
        coef, *_ = np.linalg.lstsq(design, losses, rcond=None)
        residual = float(((design @ coef - losses) ** 2).sum())
        if best is None or residual < best[0]:
            best = (residual, float(coef[0] + coef[1] * at_step**-c))
    return best[1]


class WebhookSender:
    """POSTs JSON from a daemon thread: a timeout per attempt, RETRIES attempts with backoff, one
    warning (never the URL) when an alert cannot be delivered."""

    def __init__(self, url: str, say: Callable[[str], None]):
        self.url, self.say, self.pending = url, say, queue.Queue()
        self.warned = self.closed = False
        threading.Thread(target=self._run, name="alerts-webhook", daemon=True).start()

    def send(self, payload: dict) -> None:
        self.pending.put(payload)

    def close(self, wait_s: float) -> None:
        """Wait up to wait_s for what is queued (the run's last alert), then leave the rest."""
        deadline = time.monotonic() + wait_s
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        self.closed = True  # the run has ended: what is still queued is dropped, nothing more is said

    def _run(self) -> None:
        while True:
            payload = self.pending.get()
            try:
                if not self.closed:
                    self._post(payload)
            except Exception as e:  # noqa: BLE001 (an odd reply must not end the thread: later alerts)
                self._warn(type(e).__name__)
            finally:
                self.pending.task_done()

    def _warn(self, problem: str) -> None:
        if not self.warned and not self.closed:  # once: the endpoint is down, training goes on
            self.warned = True
            self.say(f"warning: the alerts webhook did not take an alert ({problem}); see metrics.jsonl")

    def _post(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        problem = ""
        for attempt in range(RETRIES):
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S) as response:
                    if response.status < 300:
                        return
                    problem = f"HTTP {response.status}"
            except urllib.error.HTTPError as e:
                problem = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                problem = type(getattr(e, "reason", e)).__name__
            time.sleep(min(2**attempt, 4))
        self._warn(problem)
