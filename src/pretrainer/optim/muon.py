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
rank gathers the momentum (full_tensor, one matrix at a time), orthogonalises it, and keeps its own
rows: the same numbers as one process, at the cost of every rank orthogonalising every matrix. The
elementwise maths runs on each rank's shards.

The step is batched, for few kernel launches: the tensors of one shape are stacked, the iteration runs
as batched matmuls over a stack of matrices, momentum, moments, bias corrections, weight decay and the
skip mask act on the stacks, and the results go back into the per-parameter state and weights with
_foreach ops (the state dict is per parameter, as ever). The formulas and their order are those of
one tensor at a time: on CPU the updates have been equal bit for bit (tests/unit/optim/test_muon.py
holds them to 1e-6). At the GPT-2 124M shape a step is 329 top-level operators instead of 7,537
(benchmarks/optimizer_ops.py).

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
# optim.muon_orthogonaliser = "polar_express": one quintic per step (Amsel et al. 2025, "The Polar
# Express", computed for 5 steps, safety factor 2e-2, cushion 2; the values nanochat uses), after
# dividing by 1.01 x the Frobenius norm
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
ORTHOGONALISERS = {"newton_schulz": (NS_COEFFICIENTS,) * NS_STEPS, "polar_express": POLAR_EXPRESS}
MOMENTUM_WARMUP = (0.85, 300)  # Muon's momentum starts here and reaches optim.muon_momentum after N steps
MAX_STACK_ELEMENTS = 1 << 26  # the most values the step stacks into one batch (256 MiB in fp32)


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


def orthogonalise(m: torch.Tensor, steps: int = NS_STEPS, method: str = "newton_schulz") -> torch.Tensor:
    """About U V^T of M = U S V^T by a quintic iteration (`method`: ORTHOGONALISERS' coefficients), on
    the wide orientation (fewer rows than columns: the Gram matrix is the smaller one). M is one matrix
    or a stack of matrices of one shape (k x A x B), each orthogonalised on its own (batched matmuls: the
    same numbers as one at a time). bf16 on CUDA (as the speedrun), float32 elsewhere (CPUs without fast
    bf16 matmuls). -> float32."""
    x = m.to(torch.bfloat16 if m.is_cuda else torch.float32)
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(0)
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    if method == "newton_schulz":
        x = x / norm.clamp(min=1e-7)  # spectral norm <= 1
    else:  # its coefficients assume a margin below 1
        x = x / (norm * 1.01 + 1e-6)
    for a, b, c in ORTHOGONALISERS[method][:steps]:
        gram = torch.bmm(x, x.mT)
        x = a * x + torch.bmm(b * gram + torch.bmm(c * gram, gram), x)
    x = (x.mT if tall else x).float()
    return x[0] if single else x


def newton_schulz_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> int:
    """Multiply-adds x 2 of one orthogonalisation of a matrix of this shape (per optimizer step):
    per step X X^T (2 r^2 c), the Gram matrix squared (2 r^3) and the product with X (2 r^2 c), r <= c."""
    r, c = sorted(shape[:2])
    return steps * (4 * r * r * c + 2 * r**3)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), or the tensor itself: the elementwise maths of the step
    runs on the shards, as DTensor's own elementwise ops would."""
    return t.to_local() if hasattr(t, "to_local") else t


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """k tensors of one shape as one k x ... tensor: a copy, or a view of the only one."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def buckets(params: list[torch.Tensor]) -> list[list[int]]:
    """The step's batches: indices into `params` of the tensors of one shape, sharding, dtype and device
    (in order of first appearance), cut into runs of at most MAX_STACK_ELEMENTS values so that the
    step's stacked copies stay bounded whatever the model's size."""
    by_key: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        local = _local(p)
        key = (tuple(p.shape), tuple(local.shape), p.dtype, _local(p.grad).dtype, local.device)
        key += (str(p.placements),) if hasattr(p, "placements") else ()
        by_key.setdefault(key, []).append(i)
    out = []
    for members in by_key.values():
        per = max(1, MAX_STACK_ELEMENTS // max(1, params[members[0]].numel()))
        out += [members[i : i + per] for i in range(0, len(members), per)]
    return out


class MuonAdamW(torch.optim.Optimizer):
    """param groups with "muon": True get Muon, the others AdamW; lr, weight_decay, betas and eps are the
    groups' (set_lr drives both). State per parameter: Muon's `momentum_buffer`, AdamW's `exp_avg`,
    `exp_avg_sq` and `step`; a group's `steps` (Muon's momentum warm-up) is in its param group, so the
    state dict carries it.

    The step is batched by buckets() (the module's docstring): a few dozen operators per shape instead
    of about 50 per tensor."""

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
        *,
        orthogonaliser: str = "newton_schulz",
        cautious_weight_decay: bool = False,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "momentum": momentum, "muon": False, "steps": 0}
        self.orthogonaliser, self.cautious_weight_decay = orthogonaliser, cautious_weight_decay
        super().__init__(groups, defaults)
        self.found_inf: torch.Tensor | None = None
        # the last step's squared update norms: one tensor per bucket, and where each parameter's is
        self.update_sq: list[torch.Tensor] = []
        self.update_order: list[int] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.update_sq = []
        # kept: a 0-d bool on the device, read by torch.where, never by the host; None: every step is kept
        kept = None if self.found_inf is None else self.found_inf == 0
        order = []  # for each bucket's parameters (bucket order), its position in the groups' order
        for group in self.param_groups:
            group["steps"] += 1
            params = [p for p in group["params"] if p.grad is not None]
            batches = buckets(params)
            if batches:
                (self._muon if group["muon"] else self._adamw)(group, params, batches, kept)
            order += [len(order) + i for batch in batches for i in batch]
        self.update_order = sorted(range(len(order)), key=order.__getitem__)
        return None

    def update_norm(self, skipped: torch.Tensor | None = None) -> torch.Tensor:
        """||delta theta|| of the last step (0 when it was skipped); under FSDP2 the shards' sums are
        reduced (a collective). The squares are summed in the parameters' order, as one at a time."""
        if not self.update_sq:
            device = next(p.device for group in self.param_groups for p in group["params"])
            return torch.zeros((), device=device)
        sums = [v for s in self.update_sq for v in (s.full_tensor() if hasattr(s, "full_tensor") else s)]
        return torch.stack([sums[i] for i in self.update_order]).sum().sqrt()

    def _squares(self, update: torch.Tensor, p: torch.Tensor) -> None:
        """Record each stacked update's squared norm (this rank's part of it under FSDP2)."""
        sums = update.float().pow(2).sum(dim=tuple(range(1, update.dim())))
        if hasattr(p, "placements"):  # a shard's sum: a partial sum over the sharded mesh dimensions
            from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

            placements = [Partial() if isinstance(pl, Shard) else Replicate() for pl in p.placements]
            sums = DTensor.from_local(sums, p.device_mesh, placements, run_check=False)
        self.update_sq.append(sums)

    def _muon(self, group: dict, params: list[torch.Tensor], batches: list[list[int]], kept) -> None:
        start, warmup_steps = MOMENTUM_WARMUP
        mu = group["momentum"]
        mu = start + (mu - start) * min(1.0, group["steps"] / warmup_steps) if mu > start else mu
        lr, wd = group["lr"], group["weight_decay"]
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        for batch in batches:
            ps = [params[i] for i in batch]
            bufs = [_local(self.state[p]["momentum_buffer"]) for p in ps]
            grads = _stack([_local(p.grad) for p in ps])
            momentum = _stack(bufs)
            if kept is None:
                momentum.mul_(mu).add_(grads)
            else:
                momentum = torch.where(kept, momentum * mu + grads, momentum)
            torch._foreach_copy_(bufs, momentum.unbind(0))
            nesterov = grads.add(momentum, alpha=mu)
            if hasattr(ps[0], "full_tensor"):  # FSDP2: this rank's rows of each matrix
                full = orthogonalise(
                    torch.stack([_gather(n, p) for n, p in zip(nesterov.unbind(0), ps)]),
                    method=self.orthogonaliser,
                )
                # every rank has the whole update: each keeps its own rows (no communication)
                full = _stack([_own_rows(f, p) for f, p in zip(full.unbind(0), ps)])
            else:
                full = orthogonalise(nesterov, method=self.orthogonaliser)
            scaled_lr = lr * 0.2 * math.sqrt(max(ps[0].shape[0], ps[0].shape[1]))
            update = full.to(ps[0].dtype).mul_(scaled_lr)
            weights = [_local(p) for p in ps]
            if wd and self.cautious_weight_decay:  # only where the step moves the weight towards 0 too
                stacked = _stack(weights)
                update.add_(stacked * (update * stacked >= 0), alpha=lr * wd)
            elif wd:  # decoupled weight decay, on the weights before the step
                update.add_(_stack(weights), alpha=lr * wd)
            if kept is not None:
                update = torch.where(kept, update, 0.0)  # p - 0 is p, bit for bit; a NaN never lands
            self._squares(update, ps[0])
            torch._foreach_sub_(weights, update.unbind(0))

    def _adamw(self, group: dict, params: list[torch.Tensor], batches: list[list[int]], kept) -> None:
        (beta1, beta2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        for p in params:
            if not self.state[p]:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                self.state[p]["exp_avg"] = torch.zeros_like(p)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
        # the counts and the bias corrections stay on the device (no host sync), one 0-d tensor per
        # parameter as before; the powers are taken one count at a time, as one parameter at a time did
        ordered = [params[i] for batch in batches for i in batch]
        device = _local(ordered[0]).device
        counts = [self.state[p]["step"] for p in ordered]
        counts = [s if s.device == device else s.to(device) for s in counts]
        one = torch.ones((), device=device) if kept is None else kept.float()
        counts = torch._foreach_add(counts, [one] * len(counts))
        for p, count in zip(ordered, counts):
            self.state[p]["step"] = count
        corrections = []
        for beta in (beta1, beta2):
            base = torch.full((), beta, dtype=torch.float32, device=device)
            corrections.append(1 - torch.stack(torch._foreach_pow([base] * len(counts), counts)))
        done = 0
        for batch in batches:
            ps = [params[i] for i in batch]
            grads = _stack([_local(p.grad) for p in ps])
            avgs = [_local(self.state[p]["exp_avg"]) for p in ps]
            squares = [_local(self.state[p]["exp_avg_sq"]) for p in ps]
            exp_avg, exp_avg_sq = _stack(avgs), _stack(squares)
            if kept is None:
                exp_avg.lerp_(grads, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
            else:
                exp_avg = torch.where(kept, exp_avg.lerp(grads, 1 - beta1), exp_avg)
                fresh = exp_avg_sq.mul(beta2).addcmul_(grads, grads, value=1 - beta2)
                exp_avg_sq = torch.where(kept, fresh, exp_avg_sq)
            torch._foreach_copy_(avgs, exp_avg.unbind(0))
            torch._foreach_copy_(squares, exp_avg_sq.unbind(0))
            shape = (len(batch),) + (1,) * (grads.dim() - 1)
            bias1, bias2 = (c[done : done + len(batch)].view(shape) for c in corrections)
            done += len(batch)
            denominator = (exp_avg_sq / bias2).sqrt_().add_(eps)
            update = (exp_avg / bias1).div_(denominator).mul_(lr)
            weights = [_local(p) for p in ps]
            if wd:
                update.add_(_stack(weights), alpha=lr * wd)
            if kept is not None:
                update = torch.where(kept, update, 0.0)
            self._squares(update, ps[0])
            torch._foreach_sub_(weights, update.unbind(0))


def _gather(shard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """FSDP2: the whole matrix from each rank's rows of it (a collective)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    ).full_tensor()


def _own_rows(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """FSDP2: this rank's rows of a matrix every rank holds whole (no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = p.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, p.placements).to_local()


def hidden_flags(model: nn.Module) -> list[bool]:
    """For each of model.parameters() (tied weights once): whether Muon updates it."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [is_hidden_matrix(name, p, embedding_ids) for name, p in model.named_parameters()]


def optimizer_flops_per_step(model: nn.Module) -> int:
    """Muon's own matrix FLOPs per step beyond the model's: its orthogonalisations (each rank does them
    all under FSDP2; counted once, as the work the run needs). AdamW's elementwise update is not
    counted (as in every MFU convention)."""
    return sum(
        newton_schulz_flops(tuple(p.shape))
        for p, hidden in zip(model.parameters(), hidden_flags(model))
        if hidden
    )


# --- optim.name = "muon" (config/optimizers.py's entry names this module) ---


def build(groups: list[dict], model: nn.Module, cfg, *, entry, compile_step: bool) -> MuonAdamW:
    groups = with_muon_group(groups, model, cfg.weight_decay)
    return MuonAdamW(
        groups,
        cfg.lr,
        (cfg.beta1, cfg.beta2),
        cfg.eps,
        cfg.muon_momentum,
        orthogonaliser=cfg.muon_orthogonaliser,
        cautious_weight_decay=cfg.cautious_weight_decay,
    )


def implementation(optimizer: torch.optim.Optimizer) -> str:
    method = {"newton_schulz": "Newton-Schulz", "polar_express": "Polar Express"}[optimizer.orthogonaliser]
    cautious = ", cautious weight decay" if optimizer.cautious_weight_decay else ""
    return (
        f"optim/muon.MuonAdamW: Muon ({method}, 5 steps{cautious}) for the hidden matrices, AdamW for the "
        "rest"
    )


def update_norm(optimizer: MuonAdamW, skipped: torch.Tensor | None = None) -> torch.Tensor:
    return optimizer.update_norm(skipped)  # measured as it stepped: Muon's update is not Adam's


flops_per_step = optimizer_flops_per_step
