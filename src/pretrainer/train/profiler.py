"""The profiler, as a trainer component: train.profile_steps steps from train.profile_at_step traced
with torch.profiler (CPU, and CUDA kernels on a GPU) into a Chrome trace per rank,
RUN_DIR/profile/trace-steps-A-B-rankR.json (chrome://tracing or ui.perfetto.dev), each step a
labelled range ("step N"). On CUDA the allocator's history over the window is also dumped,
RUN_DIR/profile/memory-steps-A-B-rankR.pickle, for pytorch.org/memory_viz. Outside its window it
costs two integer comparisons per step; with train.profile_at_step = 0 it is not built at all."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pretrainer.train.component import Component, Step

MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept for the snapshot


class Profiler(Component):
    name = "profiler"

    def __init__(self, out_dir: Path, first: int, last: int, *, rank: int, device: torch.device, say):
        self.out_dir, self.first, self.last, self.rank, self.device = out_dir, first, last, rank, device
        self.say, self.profile, self.step_range = say, None, None

    @classmethod
    def build(cls, trainer) -> Profiler | None:
        first = trainer.cfg.train.profile_at_step
        if not first:
            return None
        last = first + trainer.cfg.train.profile_steps - 1
        env = trainer.env
        return cls(
            trainer.run_dir / "profile", first, last, rank=env.rank, device=env.device, say=trainer.say
        )

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def before_step(self, step: Step) -> None:
        self._end_range()  # a step that was dropped or rolled back never reached after_step
        if self.profile is None and self.first <= step.number <= self.last:
            self._start()
        if self.profile is not None:
            self.step_range = torch.profiler.record_function(f"step {step.number}")
            self.step_range.__enter__()

    def after_step(self, step: Step) -> None:
        self._end_range()
        if self.profile is not None and step.number >= self.last:
            self._stop(step.number)

    def close(self) -> None:
        """The run ended inside the window: what was traced is still written (without waiting for the
        device, which a failed collective may have left stuck)."""
        self._end_range()
        if self.profile is not None:
            self._stop(self.last, wait_for_device=False)

    def _end_range(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profile.__enter__()

    def _stop(self, last: int, wait_for_device: bool = True) -> None:
        if self.cuda and wait_for_device:
            torch.cuda.synchronize(self.device)  # the window's kernels belong in its trace
        profile, self.profile = self.profile, None
        profile.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"steps-{self.first}-{last}-rank{self.rank}"
        trace = self.out_dir / f"trace-{name}.json"
        written = [_atomically(trace, profile.export_chrome_trace)]
        if self.cuda:
            snapshot = self.out_dir / f"memory-{name}.pickle"
            written.append(_atomically(snapshot, torch.cuda.memory._dump_snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.say(f"profiler: steps {self.first}-{last} traced: {', '.join(str(p) for p in written)}")


def _atomically(path: Path, write) -> Path:
    """write(temp path), then rename: a reader never sees half a trace."""
    temp = path.with_name(f".{path.name}.tmp")
    write(str(temp))
    os.replace(temp, path)
    return path
