"""One trainer per run dir, every step: rank 0 checks that the run dir and its lock are still its own
(artifacts/run_lock.py). A run dir moved or replaced under it, or its lock taken by another trainer after
someone removed .lock, stops this trainer before its next step, with one line and without another write
there: no checkpoint, no exit record, no run.on_exit (the run is the other trainer's now)."""

from __future__ import annotations

from pretrainer.core.errors import EXIT_USER_ERROR
from pretrainer.train.component import Component, Step, StopRequest, Votes


class RunDirGuard(Component):
    name = "run_dir"

    @classmethod
    def build(cls, trainer) -> RunDirGuard:
        return cls(trainer.lock if trainer.env.is_main else None)

    def __init__(self, lock):
        self.lock, self.why = lock, None

    def vote(self, step: Step, votes: Votes) -> None:
        self.why = self.lock.lost() if self.lock is not None else None
        votes.cast("run_dir_lost", self.why is not None)

    def stop_request(self, step: Step, agreed: dict[str, int]) -> StopRequest | None:
        if not agreed["run_dir_lost"]:
            return None
        if self.lock is not None:
            self.lock.abandon()
        why = self.why or "rank 0's run dir is another trainer's now; every rank stops"
        return StopRequest("run_dir_lost", why, EXIT_USER_ERROR)
