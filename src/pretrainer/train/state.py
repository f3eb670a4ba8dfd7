"""The trainer state: everything that moves as a run trains, in one object whose state_dict is
what a checkpoint saves and what resume and rollback restore.

    state.step, state.tokens            optimizer steps taken, tokens consumed (all ranks together)
    state.trained_tokens                of those, the targets the loss counted (all, unless a loss mask or
                                        document packing leaves some out)
    state.clock                         wall-clock seconds over this process and every earlier one
    state.loader                        the data cursor (SequenceLoader.state_dict)
    + the Python, NumPy, torch (and this GPU's) RNG states of every rank, captured at save time

Resume restores all of it (`load_state_dict`; the trainer's components restore their own parts of
state.json: the spike guard's, for one). A rollback restores only the model's side of it (`rewind`:
step, tokens, RNG): the data keeps going forward past the bad window, the clock keeps running, and
the spike guard remembers that it rolled back.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pretrainer.data.loader import SequenceLoader
from pretrainer.train.checkpoint import rank_rng_state, rng_state, set_rng_state
from pretrainer.train.distributed import DistEnv


class RunClock:
    """Wall-clock seconds of a run over all its processes (resumes add up), each from its entry into
    train(): start-up is paid for as the steps are."""

    def __init__(self):
        self.before = 0.0  # seconds run by earlier processes of this run
        self.started = time.time()
        self.reading: float | None = None  # while frozen: the one reading everyone gets

    def elapsed(self) -> float:
        return self.reading if self.reading is not None else self.before + time.time() - self.started

    @contextmanager
    def frozen(self):
        """One reading of the clock for everything inside (a state.json's parts agree on the time)."""
        self.reading = self.elapsed()
        try:
            yield
        finally:
            self.reading = None


class TrainerState:
    def __init__(self, loader: SequenceLoader, clock: RunClock, env: DistEnv):
        self.step, self.tokens, self.trained_tokens = 0, 0, 0
        # the step of the newest checkpoint this run wrote or restored (not itself saved)
        self.saved_step = -1
        self.loader, self.clock = loader, clock
        self.env = env  # whose RNG state this process restores (each rank its own)

    def advance(self, tokens: int, trained_tokens: int) -> None:
        self.step += 1
        self.tokens += tokens
        self.trained_tokens += trained_tokens

    def state_dict(self) -> dict:
        elapsed = self.clock.elapsed()
        return {
            "step": self.step,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "elapsed_s": elapsed,
            "data": self.loader.state_dict(),
            "rng": rng_state(self.env.device),  # rank 0's; write_checkpoint adds every rank's
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens, self.clock.before = state["step"], state["tokens"], state["elapsed_s"]
        # older checkpoints: every token was trained
        self.trained_tokens = state.get("trained_tokens", self.tokens)
        self.saved_step = self.step
        self.loader.load_state_dict(state["data"])
        self.restore_rng(state)

    def rewind(self, state: dict) -> None:
        """Back to a checkpoint's step, tokens and RNG; the data cursor and the clock go on."""
        self.step, self.tokens = state["step"], state["tokens"]
        self.trained_tokens = state.get("trained_tokens", self.tokens)
        # the data cursor and spike state move on from the checkpoint's: a stop must save again
        self.saved_step = -1
        self.restore_rng(state)

    def restore_rng(self, state: dict) -> None:
        set_rng_state(rank_rng_state(state, self.env.rank, self.env.world_size), self.env.device)
