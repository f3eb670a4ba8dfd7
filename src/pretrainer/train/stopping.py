"""Why a run stops before max_steps, decided the same way on every rank.

    stopper = Stopper(cfg.budget, env, clock, log, say)
    stopper.start(step, started)                  # installs the SIGTERM/SIGINT handlers
    request = stopper.poll(step, elapsed, max_steps)   # once per step: None, or why to stop
    if request: (checkpoint if request.checkpoint) and raise RunStopped(request.message, request.exit_code)

Two sources: a signal on any rank (spot preemption, scancel, Ctrl-C) and the budget guard on rank 0
(budget.json or the $ estimate, see budget.py). Each step every rank contributes its view to one
small all-reduce (max), so all ranks stop at the same step and write one checkpoint together.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pretrainer.config import BudgetConfig
from pretrainer.errors import EXIT_BUDGET_PROJECTED, EXIT_BUDGET_SPENT, exit_code_for_signal
from pretrainer.train.budget import ACTION_CODES, BudgetGuard, estimated_spend_usd
from pretrainer.train.distributed import DistEnv, agree_max


class StopSignal:
    """SIGTERM / SIGINT (spot preemption, Ctrl-C): remember it, finish the step, checkpoint, exit.
    A second signal interrupts at once."""

    def __init__(self):
        self.signum, self.previous = 0, {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


@dataclass
class StopRequest:
    reason: str  # "budget_stop", "budget_halt" or "signal"
    message: str
    exit_code: int
    checkpoint: bool  # write one before exiting (not when the money is already spent)


class Stopper:
    def __init__(self, budget: BudgetConfig, env: DistEnv, clock: Callable[[], float],
                 log: Callable[[dict], None], say: Callable[[str], None]):
        self.budget, self.env, self.log, self.say = budget, env, log, say
        self.guard = BudgetGuard(budget, env.world_size, clock=clock) if budget.cap_usd and env.is_main else None
        self.signal = StopSignal()
        self.reading = None  # the budget guard's latest reading (budget.json or the estimate)
        self.started, self.first_step = time.time(), 0

    def start(self, first_step: int, started: float) -> None:
        """From here on a signal asks for a graceful stop; `started` times the steps for the projection."""
        self.first_step, self.started = first_step, started
        self.signal.install()

    def close(self) -> None:
        self.signal.restore()

    def spent_usd(self, elapsed_s: float) -> float:
        if self.reading is not None:
            return self.reading.spent_usd
        return estimated_spend_usd(self.budget.usd_per_gpu_hour, self.env.world_size, elapsed_s)

    def poll(self, step: int, elapsed_s: float, max_steps: int) -> StopRequest | None:
        budget_action = ACTION_CODES["ok"]
        if self.guard is not None:
            step_time = (time.time() - self.started) / max(step - self.first_step, 1)
            decision = self.guard.check(elapsed_s, (max_steps - step) * step_time)
            if decision is not None:
                self.reading = decision.reading
                problem = decision.reading.problem
                if problem and problem not in self.guard.reported:
                    self.guard.reported.add(problem)
                    self.say(f"budget: {problem}")
                    self.log({"step": step, "budget_problem": 1.0})
                if decision.action != "ok":
                    self.say(decision.message)
                    self.log({"step": step, f"budget_{decision.action}": 1.0, "spent_usd": decision.reading.spent_usd,
                              "projected_usd": decision.reading.projected_total_usd})
                budget_action = ACTION_CODES[decision.action]
        budget_action, signum = agree_max([budget_action, self.signal.signum], self.env)  # one tiny all-reduce per step
        cap = f"budget.cap_usd ${self.budget.cap_usd:.2f}"
        if budget_action == ACTION_CODES["halt"]:
            return StopRequest("budget_halt", f"budget: spent over {cap} at step {step}; stopped without a checkpoint",
                               EXIT_BUDGET_SPENT, checkpoint=False)
        resume = f"checkpoint written at step {step}; run the same command to resume"
        if budget_action == ACTION_CODES["stop"]:
            return StopRequest("budget_stop", f"budget: projected cost over {cap}: {resume}", EXIT_BUDGET_PROJECTED,
                               checkpoint=True)
        if signum:
            return StopRequest("signal", f"signal {signal.Signals(signum).name}: {resume}", exit_code_for_signal(signum),
                               checkpoint=True)
        return None
