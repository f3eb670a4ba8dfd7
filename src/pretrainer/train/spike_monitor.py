"""Spike detection on the device (train/spikes.py describes it): a rolling window of loss and grad-norm
values, a value beyond mean + spike.sigmas x std flagged, non-finite values at once, no host sync per
step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Flags:
    spike: torch.Tensor  # bool, on the device
    nonfinite: torch.Tensor
    regime: torch.Tensor  # this step ended a run of max_consecutive flags: the new level is normal now


class SpikeMonitor:
    """Rolling mean + k sigma over loss and grad norm, all on the device (no host sync)."""

    def __init__(
        self, window: int, min_values: int, sigmas: float, device: torch.device, max_consecutive: int = 0
    ):
        self.window, self.min_values, self.sigmas = window, min_values, sigmas
        self.max_consecutive = min(max_consecutive, window)  # 0: never re-baseline
        self.values = torch.zeros(2, window, device=device)  # row 0 loss, row 1 grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)
        # values before detection is on
        self.required = torch.full((), min_values, dtype=torch.long, device=device)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.recent = torch.zeros(2, window, device=device)  # the current run of flagged (finite) values
        self.consecutive = torch.zeros((), dtype=torch.long, device=device)

    def update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Flags:
        current = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        nonfinite = ~torch.isfinite(current).all()
        valid = (torch.arange(self.window, device=current.device) < self.count).float()
        n = valid.sum().clamp(min=1)
        mean = (self.values * valid).sum(dim=1) / n
        std = (((self.values - mean[:, None]) * valid) ** 2).sum(dim=1).div((n - 1).clamp(min=1)).sqrt()
        threshold = mean + self.sigmas * torch.maximum(std, 1e-3 * mean.abs())
        spike = ((current > threshold).any() & (self.count >= self.required)) | nonfinite
        # a run of finite flags: remember its values; at max_consecutive they become the new window
        finite_spike = spike & ~nonfinite
        slot = (self.consecutive % self.window).view(1, 1).expand(2, 1)
        self.recent.scatter_(
            1, slot, torch.where(finite_spike, current, self.recent.gather(1, slot).squeeze(1)).view(2, 1)
        )
        self.consecutive.copy_(
            torch.where(finite_spike, self.consecutive + 1, torch.where(nonfinite, self.consecutive, 0))
        )
        regime = (self.consecutive >= self.max_consecutive) & (self.max_consecutive > 0)
        spike = spike & ~regime
        keep = ~spike  # flagged values stay out of the window, so a burst cannot hide itself
        slot = self.position.view(1, 1).expand(2, 1)
        self.values.scatter_(
            1, slot, torch.where(keep, current, self.values.gather(1, slot).squeeze(1)).view(2, 1)
        )
        self.position.copy_((self.position + keep.long()) % self.window)
        self.count.copy_(torch.clamp(self.count + keep.long(), max=self.window))
        # new regime: the window restarts from the run's values (this step's last)
        self.values.copy_(torch.where(regime, self.recent, self.values))
        self.count.copy_(torch.where(regime, torch.clamp(self.consecutive, max=self.window), self.count))
        self.position.copy_(torch.where(regime, self.count % self.window, self.position))
        # detection stays on in the new regime
        self.required.copy_(torch.where(regime, self.count, self.required))
        self.consecutive.copy_(torch.where(regime, 0, self.consecutive))
        return Flags(spike=spike, nonfinite=nonfinite, regime=regime)

    def state_dict(self) -> dict:
        return {
            "values": self.values.tolist(),
            "count": int(self.count),
            "position": int(self.position),
            "recent": self.recent.tolist(),
            "consecutive": int(self.consecutive),
            "required": int(self.required),
        }

    def load_state_dict(self, state: dict) -> None:
        self.values.copy_(torch.tensor(state["values"], device=self.values.device))
        self.count.fill_(state["count"])
        self.position.fill_(state["position"])
        if "recent" in state:  # absent in checkpoints written before regime changes existed
            self.recent.copy_(torch.tensor(state["recent"], device=self.recent.device))
            self.consecutive.fill_(state["consecutive"])
            self.required.fill_(state["required"])
