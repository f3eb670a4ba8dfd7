"""8-bit and 4-bit AdamW (optim.name = "adamw8bit" | "adamw4bit"): torchao's block-wise quantised moments.

AdamW keeps two fp32 moments, 8 bytes per parameter: at 1.2B parameters 9.6 GB of a GPU's memory.
torchao stores each moment block-wise quantised through a lookup table (Dettmers et al. 2022, 8-bit,
blocks of 256; Li et al. 2023, 4-bit, blocks of 128), dequantising one parameter at a time inside the
step: about 2.03 or 1.06 bytes per parameter. Like bitsandbytes, tensors under 4,096 values (norm
gains, biases) keep fp32 moments. Parameter groups, weight decay and the schedule are AdamW's.

Two differences from torchao's own step, both here so the loop treats every optimizer alike:
- `found_inf`: fused AdamW drops the whole update (weights, moments, step count) on the device when
  the loop sets this 1; torchao has no such input, so a step with found_inf = 1 returns before any
  change, which is the same outcome at the price of one host sync per step (free on CPU).
- torchao compiles its per-parameter update (torch.compile, one graph per shape). That is what makes
  it fast on a GPU, and what costs ~35 s of compilation per process on CPU for a 1M-parameter model.
  The update is compiled on CUDA or with train.compile, and runs eagerly otherwise; the arithmetic is
  torchao's in both cases (its `single_param_adam`).
"""

from __future__ import annotations

import torch

from pretrainer.core.device import import_torchao
from pretrainer.optim.adamw import adamw_update_norm
from pretrainer.optim.sizes import BLOCK_SIZE  # values per block scale: plan counts with the same numbers

_torchao_optim = import_torchao("optim.name = adamw8bit / adamw4bit").optim
from torchao.optim.adam import single_param_adam  # noqa: E402 (after the import that explains a missing torchao)


class _LowBitStep:
    """The step shared by both widths (see the module docstring)."""

    compile_step = True
    found_inf: torch.Tensor | None = None
    quantised_state = True  # train/distributed.load_full_state: no tensor broadcast for these moments

    @torch.no_grad()
    def step(self, closure=None):
        if self.found_inf is not None and bool(self.found_inf):  # the host sync fused AdamW avoids
            return None
        if self.compile_step:
            return super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # torchao's own initialisation: quantised above MIN_QUANTISED_NUMEL, else fp32
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                single_param_adam(
                    p.detach(),
                    p.grad,
                    state["step"],
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    None,
                    group["lr"],
                    group["betas"][0],
                    group["betas"][1],
                    group["weight_decay"],
                    group["eps"],
                    True,
                    False,
                )
        return None


class AdamW8bit(_LowBitStep, _torchao_optim.AdamW8bit):
    pass


class AdamW4bit(_LowBitStep, _torchao_optim.AdamW4bit):
    pass


# the tensor subclasses an optimizer.pt may hold (loaded by name from this list only, never by import path)
STATE_CLASSES = {
    cls.__name__: cls
    for cls in (_torchao_optim.subclass_8bit.OptimState8bit, _torchao_optim.subclass_4bit.OptimState4bit)
}


def build(groups: list[dict], model, cfg, *, entry, compile_step: bool) -> torch.optim.Optimizer:
    """optim.name = adamw8bit | adamw4bit: entry.moment_bits picks the class."""
    bits = entry.moment_bits
    optimizer = (AdamW8bit if bits == 8 else AdamW4bit)(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, block_size=BLOCK_SIZE[bits]
    )
    optimizer.compile_step = compile_step
    return optimizer


def implementation(optimizer: torch.optim.Optimizer) -> str:
    import importlib.metadata

    version = importlib.metadata.version("torchao")
    compiled = "compiled" if optimizer.compile_step else "eager"
    return f"torchao.optim.{type(optimizer).__name__} (torchao {version}), update {compiled}"


# the step used the moments dequantised: Adam's maths, within their quantisation error (tests/unit/optim)
update_norm = adamw_update_norm
