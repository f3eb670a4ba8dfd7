"""Where weights come from: a run directory (or one of its checkpoints), or `init.from`.

    run = open_run("runs/tiny")            # the newest complete checkpoint, its config and tokenizer
    model = build_model(run.cfg, run.load_weights, str(run.checkpoint))
    source_cfg, load = init_source("hf:path/to/gpt2")   # or a pretrainer run/checkpoint dir

`sample`, `export` and `eval` read run directories only through `open_run`, so the run-dir layout
(RUN_DIR/checkpoints/step-N/, RUN_DIR/tokenizer/) is written down in one place for readers.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrainer.artifacts.checkpoint import (
    MARKER,
    list_checkpoints,
    load_model_weights,
    pin_checkpoint,
    read_trainer_state,
    resolve_run_or_checkpoint,
    verify_checkpoint,
    weights_problem,
)
from pretrainer.config.load import apply_overrides, from_dict
from pretrainer.config.schema import Config, ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.data.tokenizers.base import Tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer
from pretrainer.model import Transformer

WeightLoader = Callable[[], dict[str, torch.Tensor]]


@dataclass
class OpenRun:
    checkpoint: Path  # a complete checkpoint directory
    state: dict  # its state.json
    cfg: Config  # the resolved config it was trained with

    @property
    def run_dir(self) -> Path:
        return self.checkpoint.parent.parent  # RUN_DIR/checkpoints/step-N

    @property
    def step(self) -> int:
        return self.state["step"]

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.run_dir / "tokenizer")

    def load_weights(self) -> dict[str, torch.Tensor]:
        """The weights, checked name by name and shape by shape against the config they were saved with
        (weights of another shape under a forged checksum are refused, not exported with wrong metadata)."""
        from safetensors.torch import load_file

        weights = load_file(self.checkpoint / "model.safetensors")
        with torch.device("meta"):
            problem = weights_problem(Transformer(self.cfg.model), weights, str(self.checkpoint))
        if problem:
            raise UserError(problem)
        return weights

    def lineage(self) -> dict:
        """This run as a parent: which checkpoint (and the sha256 of its weights), the tokens it saw and
        trained on, and its own parent, so a pretrain -> mid-train -> SFT chain reads back from the last
        run."""
        recorded = json.loads((self.checkpoint / MARKER).read_text()).get("files", {})
        state = self.state
        return {
            "init_from": str(self.run_dir),
            "checkpoint": str(self.checkpoint),
            "step": self.step,
            "model_sha256": recorded.get("model.safetensors", {}).get("sha256"),
            "config_sha256": state.get("config_sha256"),
            "tokens": state.get("tokens"),
            "trained_tokens": state.get("trained_tokens", state.get("tokens")),
            "data": state.get("dataset", {}).get("dir") or state.get("dataset", {}).get("mixture"),
            "parent": state.get("parent"),
        }


def open_run(path: str | Path) -> OpenRun:
    """A run dir (-> its newest intact checkpoint, damaged newer ones reported) or a checkpoint dir
    (which must be intact: weights and state.json match their recorded sha256); one-line errors."""
    path = Path(path)
    newest = resolve_run_or_checkpoint(path)
    candidates = [newest] if newest == path else list(reversed(list_checkpoints(path)))
    for checkpoint in candidates:
        pin_checkpoint(checkpoint)  # rotation in a running trainer leaves it while this process reads it
        problem = verify_checkpoint(checkpoint, files=("model.safetensors", "state.json"))
        if not problem:
            state = read_trainer_state(checkpoint)
            return OpenRun(checkpoint, state, from_dict(state["config"], f"{checkpoint}/state.json"))
        if len(candidates) == 1:
            raise UserError(f"{checkpoint}: {problem}")
        print(
            f"warning: damaged checkpoint {checkpoint}: {problem}; using the one before it", file=sys.stderr
        )
    raise UserError(f"{path}: none of its {len(candidates)} checkpoints is intact")


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of cfg with --section.key=value overrides applied and checked."""
    return apply_overrides(copy.deepcopy(cfg), overrides)


@dataclass
class InitSource:
    """What `init.from` names: its model config, its weights (loaded on demand), its tokenizer (a
    pretrainer run's; None for hf: weights) and the lineage a run started from it records."""

    model: ModelConfig
    load: WeightLoader
    tokenizer: Tokenizer | None
    lineage: dict


def open_init_source(spec: str) -> InitSource:
    if spec.startswith("hf:"):
        from pretrainer.artifacts import hf_import as hf
        from pretrainer.data.hub import is_hub_spec, pull

        # hf://ORG/NAME: an export `pretrainer push` uploaded, pulled and verified; hf:DIR: a local one
        directory = pull(spec, "model") if is_hub_spec(spec) else Path(spec[len("hf:") :])
        source_cfg = hf.read_hf_config(directory)
        return InitSource(
            source_cfg,
            lambda: hf.from_hf_weights(source_cfg, hf.read_hf_weights(directory), spec),
            None,
            {"init_from": spec},
        )
    run = open_run(spec)
    return InitSource(run.cfg.model, run.load_weights, run.tokenizer(), run.lineage())


def init_source(spec: str) -> tuple[ModelConfig, WeightLoader]:
    """`init.from` -> (the source's model config, a function that loads its weights under our names)."""
    source = open_init_source(spec)
    return source.model, source.load


def grow_vocabulary(
    weights: dict[str, torch.Tensor], vocab_size: int, trained_rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Weights of a model with fewer token ids (its tokenizer, with special tokens appended since: the
    chat format's) made to fit `vocab_size`: the old rows are kept, each new row starts at the mean of
    the old ones (an average token, not noise: Hewitt, "Initializing new word embeddings", 2021).
    trained_rows: the source tokenizer's size, when new tokens land in rows the source had only as
    padding (its vocabulary padded to a multiple of 128): those rows start at the mean too, not as
    padding, which training pushed away from ever being predicted."""
    grown = dict(weights)
    for name in ("wte.weight", "lm_head.weight"):
        old = weights.get(name)
        if old is None:
            continue
        kept = min(old.shape[0], trained_rows or old.shape[0], vocab_size)
        if kept < vocab_size:
            mean = old[:kept].float().mean(dim=0, keepdim=True).to(old.dtype)
            grown[name] = torch.cat([old[:kept], mean.expand(vocab_size - kept, -1)])
    return grown


def build_model(cfg: Config, load_weights: WeightLoader | None = None, where: str = "") -> Transformer:
    """The model of a resolved config, randomly initialised (from the global RNG) or with the weights
    `load_weights` returns, checked name by name and shape by shape."""
    model = Transformer(cfg.model)
    if load_weights is not None:
        load_model_weights(model, load_weights(), where)
    return model
