"""Muon for the hidden weight matrices and AdamW for everything else, as one optimizer with one state
dict (optim.name = "muon").

Muon (Jordan et al., 2024; the modded-nanogpt speedrun's optimizer) is SGD with Nesterov momentum
whose update for a 2-D weight is orthogonalised: a quintic Newton-Schulz iteration maps the momentum
M = U S V^T to about U V^T, so every direction of the matrix moves by a similar amount. It serves the
hidden matrices (attention and MLP projections). Embeddings, the output head, norms and biases are
not matrices acting on a hidden state in that sense and keep AdamW (as in modded-nanogpt, nanochat and
Moonshot's "Muon is Scalable for LLM Training").

One learning rate: Muon's update is scaled by 0.2 sqrt(max(A, B)) for an A x B matrix, which gives it
the RMS of a typical AdamW update (Moonshot's rule, torch.optim.Muon's "match_rms_adamw"), so optim.lr
and optim.weight_decay mean the same for both parts and the schedule drives both. Muon's momentum is
optim.muon_momentum (0.95), warmed up from 0.85 over the first 300 steps (modded-nanogpt).

Distributed: under DDP every rank holds whole matrices and all-reduced gradients, so the step is the
single-process one. Under FSDP2 a rank holds a row shard; the iteration needs the whole matrix, so each
rank gathers the momentum (full_tensor), orthogonalises it, and keeps its own rows: the same numbers
as one process, at the cost of every rank orthogonalising every matrix.

`found_inf` (the loop's skip flag, 1.0 on the device) drops the whole update, AdamW's part included,
without a host sync: every write is masked by it on the device (as fused AdamW's found_inf input is),
so weights, momenta and AdamW's step counts stay as they were on a skipped step. Muon's momentum
warm-up counts optimizer calls, skipped or not, as the LR schedule counts steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# the quintic's coefficients (Keller Jordan's; torch.optim.Muon's defaults) and its steps
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MOMENTUM_WARMUP = (0.85, 300)  # Muon's momentum starts here and reaches optim.muon_momentum after N steps


def is_hidden_matrix(name: str, p: torch.Tensor, embedding_ids: set[int]) -> bool:
    """A parameter Muon updates: a 2-D weight that is neither an embedding nor the output head."""
    return p.dim() == 2 and id(p) not in embedding_ids and not name.startswith(("lm_head", "wte", "wpe"))


def with_muon_group(groups: list[dict], model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups (optim/adamw.param_groups: what is decayed) with the hidden matrices
    moved into a first group of their own, which Muon updates (decayed, as they were)."""
    hidden = {id(p) for p, flag in zip(model.parameters(), hidden_flags(model)) if flag}
    muon = [p for group in groups for p in group["params"] if id(p) in hidden]
    rest = [{**group, "params": [p for p in group["params"] if id(p) not in hidden]} for group in groups]
    return [{"params": muon, "weight_decay": weight_decay, "muon": True}, *rest]


def orthogonalise(m: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """About U V^T of M = U S V^T by the quintic Newton-Schulz iteration, on the wide orientation (fewer
    rows than columns: the Gram matrix is the smaller one). bf16 on CUDA (as the speedrun), float32
    elsewhere (CPUs without fast bf16 matmuls). -> float32."""
    a, b, c = NS_COEFFICIENTS
    x = m.to(torch.bfloat16 if m.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def newton_schulz_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> int:
    """Multiply-adds x 2 of one orthogonalisation of a matrix of this shape (per optimizer step):
    per step X X^T (2 r^2 c), the Gram matrix squared (2 r^3) and the product with X (2 r^2 c), r <= c."""
    r, c = sorted(shape[:2])
    return steps * (4 * r * r * c + 2 * r**3)


class MuonAdamW(torch.optim.Optimizer):
    """param groups with "muon": True get Muon, the others AdamW; lr, weight_decay, betas and eps are the
    groups' (set_lr drives both). State per parameter: Muon's `momentum_buffer`, AdamW's `exp_avg`,
    `exp_avg_sq` and `step`; a group's `steps` (Muon's momentum warm-up) is in its param group, so the
    state dict carries it."""

    def __init__(
        self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, momentum: float
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "momentum": momentum, "muon": False, "steps": 0}
        super().__init__(groups, defaults)
        self.found_inf: torch.Tensor | None = None
        self.update_sq: list[torch.Tensor] = []  # the last step's squared update norms, for update_norm()

    @torch.no_grad()
    def step(self, closure=None):
        self.update_sq = []
        # kept: a 0-d bool on the device, read by torch.where, never by the host; None: every step is kept
        # (FSDP2: a 0-d plain tensor beside DTensors counts as replicated, the same flag on every rank)
        kept = None if self.found_inf is None else self.found_inf == 0
        for group in self.param_groups:
            group["steps"] += 1
            if group["muon"]:
                self._muon(group, kept)
            else:
                self._adamw(group, kept)
        return None

    def update_norm(self, skipped: torch.Tensor | None = None) -> torch.Tensor:
        """||delta theta|| of the last step (0 when it was skipped); under FSDP2 the shards' sums are
        reduced (a collective)."""
        if not self.update_sq:
            device = next(p.device for group in self.param_groups for p in group["params"])
            return torch.zeros((), device=device)
        total = torch.stack(
            [s.full_tensor() if hasattr(s, "full_tensor") else s for s in self.update_sq]
        ).sum()
        return total.sqrt()

    def _muon(self, group: dict, kept: torch.Tensor | None) -> None:
        start, warmup_steps = MOMENTUM_WARMUP
        mu = group["momentum"]
        mu = start + (mu - start) * min(1.0, group["steps"] / warmup_steps) if mu > start else mu
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            if kept is None:
                buf.mul_(mu).add_(p.grad)
            else:
                buf.copy_(torch.where(kept, buf * mu + p.grad, buf))
            nesterov = p.grad.add(buf, alpha=mu)
            sharded = hasattr(nesterov, "full_tensor")  # FSDP2: this rank's rows of the matrix
            full = orthogonalise(nesterov.full_tensor() if sharded else nesterov)
            if sharded:  # every rank has the whole update: each keeps its own rows (no communication)
                from torch.distributed.tensor import DTensor, Replicate

                full = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
                full = full.redistribute(p.device_mesh, p.placements)
            scaled_lr = lr * 0.2 * math.sqrt(max(p.shape[0], p.shape[1]))
            update = full.to(p.dtype).mul_(scaled_lr)
            if wd:
                update.add_(p, alpha=lr * wd)  # decoupled weight decay, on the weights before the step
            if kept is not None:
                update = torch.where(kept, update, 0.0)  # p - 0 is p, bit for bit; a NaN never lands
            self.update_sq.append(update.float().pow(2).sum())
            p.sub_(update)

    def _adamw(self, group: dict, kept: torch.Tensor | None) -> None:
        (beta1, beta2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            # the count and the bias corrections stay on the device: no host sync
            step = state["step"].to(p.device) + (1 if kept is None else kept)
            state["step"] = step
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if kept is None:
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            else:
                exp_avg.copy_(torch.where(kept, exp_avg.lerp(p.grad, 1 - beta1), exp_avg))
                fresh = exp_avg_sq.mul(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                exp_avg_sq.copy_(torch.where(kept, fresh, exp_avg_sq))
            denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
            update = (exp_avg / (1 - beta1**step)).div_(denominator).mul_(lr)
            if wd:
                update.add_(p, alpha=lr * wd)
            if kept is not None:
                update = torch.where(kept, update, 0.0)
            self.update_sq.append(update.float().pow(2).sum())
            p.sub_(update)


def hidden_flags(model: nn.Module) -> list[bool]:
    """For each of model.parameters() (tied weights once): whether Muon updates it."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [is_hidden_matrix(name, p, embedding_ids) for name, p in model.named_parameters()]


def optimizer_flops_per_step(model: nn.Module, name: str) -> int:
    """The optimizer's own matrix FLOPs per step beyond the model's: Muon's orthogonalisations (each rank
    does them all under FSDP2; counted once, as the work the run needs). AdamW's elementwise update is
    not counted (as in every MFU convention)."""
    if name != "muon":
        return 0
    return sum(
        newton_schulz_flops(tuple(p.shape))
        for p, hidden in zip(model.parameters(), hidden_flags(model))
        if hidden
    )
