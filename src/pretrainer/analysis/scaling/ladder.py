"""A sweep's ladder: which runs, at which shapes, for how many tokens, at what learning rate and batch.

    [sweep]                      # SWEEP.toml; any other section overrides the base config
    base = "tiny-cpu.toml"       # the base config (relative to this file)
    dir = "sweeps/tiny"
    sizes = ["0.1M", "0.3M", "1M"]   # target non-embedding parameters, or shapes "LAYERSxWIDTH" ("4x128")
    mode = "tokens"              # tokens | tokens_per_param | isoflop
    tokens = [2e6, 8e6]          # mode tokens: every size at every token count

The rules, stated once:
- shape from a target N (non-embedding parameters): the base config's aspect ratio (d_model /
  n_layer) and head dimension are kept; for each depth 1..64 the width is aspect x depth rounded to
  a multiple of the head dim, and the depth whose exact count (a model built on the meta device) is
  closest to the target in log-ratio wins. KV heads keep the base's ratio of heads to KV heads.
- tokens: `tokens` per run (a list: each size at each), `tokens_per_param` x total parameters
  (Chinchilla's convention, as `plan --tokens-per-param`), or isoflop: for each budget C in
  `budgets`, D = C / FLOPs-per-token(N) (the full count: 6 x matmul parameters + attention).
  A run trains whole steps: ceil(D / tokens per step) of them, and its CSV row has the real count.
- learning rate: `lr_rule = "power"` (default): lr = base lr x (N / N_base)^(-lr_exponent), N
  non-embedding, N_base the base config's, exponent 1/3 (OLMo's ladder: lr proportional to N^-1/3);
  "constant": the base lr for every size. A base lr of auto stays auto: each size gets optim.lr's
  width rule (config/resolve.auto_lr) instead.
- batch: `batch_rule = "constant"` (default): the base config's micro-batch and grad_accum for every
  size; "power": sequences per step = base x (N / N_base)^batch_exponent (default 2/3, OLMo's
  ladder), in whole micro-batches (grad_accum grows, micro_batch stays).
- warmup, eval.every and ckpt.every keep their fraction of the base config's max_steps (warmup = auto
  is a fraction already).
- threads: a CPU run trains with `cpu_threads` torch threads (default 1) wherever it runs: in this
  process, in a --parallel-runs process, resumed. CPU sums split by the thread count, so this is what
  makes those runs' numbers the same (sweep.py applies it).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pretrainer.config.load import apply_overrides, load_config, read_toml, set_key
from pretrainer.config.schema import Config, opt
from pretrainer.core.errors import UserError

SIZE_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
MAX_DEPTH = 64
MIN_STEPS = 10  # a run shorter than this measures its warmup, not its size: refused in the plan


@dataclass
class SweepConfig:
    base: str = opt(
        "",
        "the base config every run starts from (a path relative to the sweep file); other sections of "
        "the sweep file override it",
    )
    dir: str = opt(
        "sweeps/default", "the sweep directory: runs/NAME (normal run dirs), configs/, sweep.json, sweep.csv"
    )
    sizes: str = opt(
        "",
        'comma-separated: target non-embedding parameters ("300k", "1.5M", "1e8") or shapes '
        '"LAYERSxWIDTH" ("4x128")',
    )
    mode: str = opt(
        "tokens",
        '"tokens" (each size trains `tokens`), "tokens_per_param" or "isoflop" (each budget in '
        "`budgets` at each size)",
    )
    tokens: str = opt(
        "", "mode tokens: training tokens per run, comma-separated for several (each size at each)"
    )
    tokens_per_param: float = opt(20.0, "mode tokens_per_param: tokens per (total) parameter")
    budgets: str = opt("", "mode isoflop: compute budgets in FLOPs, comma-separated (e.g. 1e15,3e15)")
    aspect_ratio: float = opt(
        0.0, "d_model / n_layer of the shapes picked for target sizes; 0 = the base config's"
    )
    head_dim: int = opt(0, "d_model / n_head of those shapes; 0 = the base config's")
    lr_rule: str = opt("power", '"power": lr = base lr x (N / N_base)^-lr_exponent; "constant": the base lr')
    lr_exponent: float = opt(1 / 3, "the power rule's exponent (OLMo's ladder: 1/3)")
    batch_rule: str = opt(
        "constant", '"constant": the base batch; "power": sequences per step x (N / N_base)^batch_exponent'
    )
    batch_exponent: float = opt(2 / 3, "the power batch rule's exponent (OLMo's ladder: 2/3)")
    gpu: str = opt(
        "", "GPU model for the plan's time and $ (as `plan --gpu`); budget.* of the base gives price and MFU"
    )
    parallel_runs: int = opt(
        1, "runs at once, one per GPU (each pinned to its own device) or on the CPU; logs in DIR/logs"
    )
    # 1 by default, whatever the machine: CPU ladders are tiny models, whose matmuls gain little from a
    # second thread, while OpenMP's spinning threads, given fewer free cores than threads (parallel runs,
    # or anything else on a shared 2-core machine), wait on each other and run many times slower; with 1
    # thread `parallel_runs` up to the core count never oversubscribes, a CSV does not depend on the core
    # count of the machine that made it, and a sweep run from a forked process works (GNU OpenMP hangs
    # in a fork of a process that used its threads). Bigger CPU models alone on a machine: raise it.
    cpu_threads: int = opt(
        1,
        "threads per CPU run (torch's), the same in this process, in --parallel-runs' processes and after "
        "a resume, so the numbers do not depend on how runs are spread; overrides OMP_NUM_THREADS; a "
        "rerun with another count than its runs trained with is refused; GPU runs are unaffected",
    )


@dataclass
class RunSpec:
    name: str
    cfg: Config  # complete: shape, steps, lr, batch, run.dir
    params_total: int
    params_non_embedding: int
    flops_per_token: int
    tokens: int  # steps x tokens per step: what the run trains
    budget_flops: float = 0.0  # isoflop: the budget the run belongs to
    extra: dict = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return float(self.flops_per_token) * self.tokens


def number(text: str, where: str) -> float:
    """'1.5M' -> 1.5e6, '300k', '2e9', '1_000' -> numbers; anything else is a one-line error."""
    raw = str(text).strip().lower().replace("_", "")
    scale = SIZE_SUFFIXES.get(raw[-1:], 1.0)
    try:
        value = float(raw[:-1] if scale != 1.0 else raw) * scale
    except ValueError:
        raise UserError(f"{where}: '{text}' is not a number (e.g. 2e6, 1.5M, 300k)") from None
    if not 0 < value < math.inf:
        raise UserError(f"{where}: '{text}' must be a positive finite number (e.g. 2e6, 1.5M)")
    return value


def listed(text: str) -> list[str]:
    return [item.strip() for item in str(text).split(",") if item.strip()]


def load_sweep(path: str | None, overrides: list[str]) -> tuple[SweepConfig, Config]:
    """A sweep file ([sweep] plus base-config overrides) or a plain config as the base, then
    --sweep.key=value and --section.key=value overrides -> (the sweep settings, the base config)."""
    sweep, raw = SweepConfig(), {}
    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"{path}: sweep file not found")
        raw = read_toml(Path(path))
    for key, value in raw.pop("sweep", {}).items():
        set_sweep_key(sweep, key, value, str(path))
    sweep_overrides = [o for o in overrides if o.startswith("--sweep.")]
    for item in sweep_overrides:
        key, _, value = item[len("--sweep.") :].partition("=")
        set_sweep_key(sweep, key, value, "command line")
    base_path = (
        (Path(path).parent / sweep.base)
        if sweep.base and path
        else (Path(sweep.base) if sweep.base else None)
    )
    if sweep.base:
        base = load_config(base_path, validated=False)
        for section, values in raw.items():  # the sweep file's other sections override the base
            if not isinstance(values, dict):
                raise UserError(f"{path}: '{section}' must be a [section] of config keys")
            for name, value in values.items():
                set_key(base, f"{section}.{name}", value, str(path))
    else:  # the file is itself the base config
        base = load_config(path, validated=False) if raw or path is None else Config()
        if path is not None and not raw and not sweep.sizes:
            raise UserError(f"{path}: a sweep needs sizes: a [sweep] section with sizes = [...], or --sizes")
    base = apply_overrides(base, [o for o in overrides if o not in sweep_overrides])
    check_sweep(sweep)
    return sweep, base


def set_sweep_key(sweep: SweepConfig, key: str, value: Any, where: str) -> None:
    key = key.replace("-", "_")
    kinds = {f.name: type(getattr(sweep, f.name)) for f in fields(sweep)}
    if key not in kinds:
        raise UserError(f"{where}: unknown sweep key '{key}'; keys of [sweep]: {', '.join(kinds)}")
    if isinstance(value, list):  # sizes = ["1M", "3M"] or tokens = [1e6, 4e6]
        value = ",".join(str(v) for v in value)
    try:
        kind = kinds[key]
        setattr(
            sweep, key, kind(value) if kind is not int or not isinstance(value, str) else int(float(value))
        )
    except ValueError:
        raise UserError(f"{where}: sweep.{key} must be {kinds[key].__name__}, got {value!r}") from None


def check_sweep(sweep: SweepConfig) -> None:
    checks = [
        (
            sweep.mode in ("tokens", "tokens_per_param", "isoflop"),
            f"sweep.mode must be tokens, tokens_per_param or isoflop, got '{sweep.mode}'",
        ),
        (
            bool(listed(sweep.sizes)),
            "sweep.sizes is empty: give target sizes (1M,3M,10M) or shapes (2x64,4x128)",
        ),
        (
            sweep.mode != "tokens" or bool(listed(sweep.tokens)),
            "sweep.mode = tokens needs sweep.tokens (e.g. 2e6)",
        ),
        (
            sweep.mode != "isoflop" or bool(listed(sweep.budgets)),
            "sweep.mode = isoflop needs sweep.budgets (FLOPs, e.g. 1e15,3e15)",
        ),
        (sweep.tokens_per_param > 0, "sweep.tokens_per_param must be positive"),
        (
            sweep.lr_rule in ("power", "constant"),
            f"sweep.lr_rule must be power or constant, got '{sweep.lr_rule}'",
        ),
        (
            sweep.batch_rule in ("power", "constant"),
            f"sweep.batch_rule must be power or constant, got '{sweep.batch_rule}'",
        ),
        (sweep.parallel_runs >= 1, "sweep.parallel_runs must be at least 1"),
        (sweep.cpu_threads >= 1, "sweep.cpu_threads must be at least 1"),
        (
            sweep.aspect_ratio >= 0 and sweep.head_dim >= 0,
            "sweep.aspect_ratio and sweep.head_dim must be >= 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"sweep: {message}")


def parameter_counts(cfg: Config) -> tuple[int, int, int]:
    """(total, non-embedding, FLOPs per token) of cfg's model, built on the meta device."""
    import torch

    from pretrainer.config.resolve import resolve_d_ff
    from pretrainer.model import Transformer, count_parameters
    from pretrainer.model.flops import flops_per_token

    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.d_ff = resolve_d_ff(model_cfg)
    with torch.device("meta"):
        counts = count_parameters(Transformer(model_cfg))
    return (
        counts["total"],
        counts["non_embedding"],
        flops_per_token(model_cfg, counts["non_embedding"])["total"],
    )


def with_shape(base: Config, n_layer: int, d_model: int, head_dim: int) -> Config:
    cfg = copy.deepcopy(base)
    m = cfg.model
    heads = d_model // head_dim
    # the base's heads per KV head
    group = max(1, base.model.n_head // (base.model.n_kv_head or base.model.n_head))
    m.n_layer, m.d_model, m.n_head = n_layer, d_model, heads
    m.n_kv_head = heads // group if heads % group == 0 and m.arch == "llama" else 0
    m.d_ff = 0  # the architecture's rule for the new width
    return cfg


def shape_for(base: Config, size: str, sweep: SweepConfig) -> Config:
    """A size ("LxD" or a target non-embedding count) -> the base config with that shape."""
    base_head_dim = base.model.d_model // base.model.n_head
    head_dim = sweep.head_dim or base_head_dim
    shape = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", size)
    if shape:
        n_layer, d_model = int(shape.group(1)), int(shape.group(2))
        if n_layer < 1 or d_model < head_dim:
            raise UserError(
                f"sweep.sizes: '{size}': needs at least 1 layer and a width of at least the head dim "
                f"{head_dim}; e.g. 2x{head_dim * 2}"
            )
        if d_model % head_dim:
            raise UserError(
                f"sweep.sizes: '{size}': width {d_model} is not a multiple of the head dim {head_dim}"
            )
        return with_shape(base, n_layer, d_model, head_dim)
    target = number(size, "sweep.sizes")
    aspect = sweep.aspect_ratio or base.model.d_model / base.model.n_layer
    best, best_gap = None, math.inf
    for depth in range(1, MAX_DEPTH + 1):
        width = max(head_dim, round(aspect * depth / head_dim) * head_dim)
        candidate = with_shape(base, depth, width, head_dim)
        count = parameter_counts(candidate)[1]
        gap = abs(math.log(count / target))
        if gap < best_gap:
            best, best_gap = candidate, gap
        if count > target:  # counts only grow with depth from here
            break
    return best


def run_name(cfg: Config, mode: str, tokens: float | None, budget: float | None, several_tokens: bool) -> str:
    name = f"l{cfg.model.n_layer}-d{cfg.model.d_model}"
    if mode == "isoflop":
        return f"c{budget:.2e}".replace("e+", "e") + "-" + name
    if several_tokens:
        return f"{name}-t{tokens:.2e}".replace("e+", "e")
    return name


def plan_runs(sweep: SweepConfig, base: Config, sweep_dir: Path) -> list[RunSpec]:
    """Every run of the sweep, in order (sizes, then token counts or budgets), with its complete config."""
    from pretrainer.config.resolve import tokens_per_step

    if not base.model.vocab_size:
        raise UserError(
            "sweep: model.vocab_size is unknown; pass --data.dir=DIR (a prepared data dir) or set it in the "
            "base"
        )
    if not base.train.micro_batch:
        raise UserError(
            "sweep: the base has train.micro_batch = auto; set a number (each run's batch is planned exactly)"
        )
    if base.train.global_batch:  # one device per run: the global batch is micro_batch x grad_accum
        if base.train.global_batch % base.train.micro_batch:
            raise UserError(
                f"sweep: train.global_batch = {base.train.global_batch} is not a multiple of "
                f"train.micro_batch "
                f"= {base.train.micro_batch}"
            )
        base = copy.deepcopy(base)
        base.train.grad_accum, base.train.global_batch = base.train.global_batch // base.train.micro_batch, 0
    base_total, base_non_embedding, _ = parameter_counts(base)
    shapes, seen = [], set()
    for size in listed(sweep.sizes):
        cfg = shape_for(base, size, sweep)
        key = (cfg.model.n_layer, cfg.model.d_model)
        if key in seen:
            raise UserError(
                f"sweep.sizes: '{size}' gives the same shape as an earlier size ({key[0]} layers x "
                f"{key[1]}); "
                f"space the sizes further apart"
            )
        seen.add(key)
        shapes.append(cfg)
    token_list = (
        [number(t, "sweep.tokens") for t in listed(sweep.tokens)] if sweep.mode == "tokens" else [None]
    )
    budgets = (
        [number(b, "sweep.budgets") for b in listed(sweep.budgets)] if sweep.mode == "isoflop" else [None]
    )
    runs = []
    for budget in budgets:
        for shape in shapes:
            total, non_embedding, per_token = parameter_counts(shape)
            for wanted in token_list:
                cfg = copy.deepcopy(shape)
                ratio = non_embedding / base_non_embedding
                if sweep.lr_rule == "power":
                    cfg.optim.lr = base.optim.lr * ratio ** (-sweep.lr_exponent)
                if sweep.batch_rule == "power":
                    sequences = base.train.micro_batch * base.train.grad_accum * ratio**sweep.batch_exponent
                    cfg.train.grad_accum = max(1, round(sequences / cfg.train.micro_batch))
                    cfg.train.global_batch = 0
                step_tokens = tokens_per_step(cfg, 1)
                tokens = {
                    "tokens": wanted,
                    "tokens_per_param": sweep.tokens_per_param * total,
                    "isoflop": budget / per_token if budget else None,
                }[sweep.mode]
                steps = math.ceil(tokens / step_tokens)
                name = run_name(cfg, sweep.mode, wanted, budget, len(token_list) > 1)
                if steps < MIN_STEPS:
                    raise UserError(
                        f"sweep: run {name} would train {steps} steps ({tokens:,.0f} tokens at "
                        f"{step_tokens:,} "
                        f"per step); at least {MIN_STEPS} are needed: raise its tokens or budget, or drop "
                        f"the size"
                    )
                # warmup, eval and checkpoints keep the base's fractions
                # (a base given in tokens or epochs has no steps of its own: its cadences stand as given)
                fraction = steps / (base.train.max_steps or steps)
                cfg.train.max_steps = steps  # the run's one horizon
                cfg.train.max_tokens, cfg.train.tokens_per_param, cfg.train.epochs = 0, 0.0, 0.0
                if base.optim.warmup_steps >= 0:  # auto stays auto: a fraction of each run's steps
                    cfg.optim.warmup_steps = min(steps - 1, round(base.optim.warmup_steps * fraction))
                cfg.eval.every = max(1, round(base.eval.every * fraction)) if base.eval.every else 0
                cfg.ckpt.every = (
                    max(1, round(base.ckpt.every * fraction)) if base.ckpt.every > 0 else base.ckpt.every
                )
                cfg.eval.tasks_every = (
                    max(1, round(base.eval.tasks_every * fraction)) if base.eval.tasks_every else 0
                )
                cfg.run.dir = str(sweep_dir / "runs" / name)
                cfg.train.stop_at_step, cfg.train.resume = 0, "auto"
                runs.append(
                    RunSpec(
                        name,
                        apply_overrides(cfg, []),
                        total,
                        non_embedding,
                        per_token,
                        steps * step_tokens,
                        budget or 0.0,
                    )
                )
    return runs
