"""On CPU: no host syncs outside logging steps, compiled and bf16 training that match eager
fp32, evaluation that does not recompile, the update/param ratio without a copy of the weights, and
the throughput watchdog. (GPU-only checks skip cleanly without CUDA.)"""

import json
from pathlib import Path

import pytest
from helpers import losses, tiny_config, tiny_overrides

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.train import step as step_module
from pretrainer.train.loop import train

AUDIT = {"train.audit_syncs": True, "log.every": 5, "train.max_steps": 12, "eval.every": 6, "ckpt.every": 6}


def audited(run: Path) -> list[float]:
    return [
        r["host_syncs_per_step"] for r in read_metrics(run / "metrics.jsonl") if "host_syncs_per_step" in r
    ]


@pytest.mark.parametrize("optimizer, action", [("adamw", "log"), ("adamw", "skip"), ("muon", "skip")])
def test_no_host_sync_outside_logging_steps(optimizer, action, stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **AUDIT, **{"spike.action": action, "optim.name": optimizer}))
    counts = audited(run)
    assert len(counts) == 3 and counts == [0.0, 0.0, 0.0], counts  # logging steps 5, 10, 12


@pytest.mark.parametrize("read", ["item", "tolist", "bool"])
def test_sync_audit_catches_a_host_read_in_a_step(read, stdlib_data, tmp_path, monkeypatch):
    """The audit is not blind: one `.item()`, `.tolist()` or `bool()` per step (here in the loss
    reduction; `.tolist()` is how the old per-step agreement read its all-reduce) is counted."""
    real = step_module.mean_across_ranks

    def with_read(value, env):
        {"item": lambda: value.item(), "tolist": lambda: value.tolist(), "bool": lambda: bool(value > 0)}[
            read
        ]()
        return real(value, env)

    monkeypatch.setattr(step_module, "mean_across_ranks", with_read)
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **AUDIT))
    assert audited(run) == [1.0, 1.0, 1.0]


@pytest.mark.cuda  # CUDA's sync debug mode
def test_no_host_sync_outside_logging_steps_cuda(stdlib_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(stdlib_data, run, **AUDIT, **{"train.device": "cuda"}))
    assert audited(run) == [0.0, 0.0, 0.0]


def test_watchdog_diagnoses_and_stops(stdlib_data, tmp_path, run_cli):
    """A minimum no CPU reaches: one line of diagnosis after the warm-up, a checkpoint, exit 6."""
    run = tmp_path / "run"
    code, out, err = run_cli(
        "train",
        *tiny_overrides(
            stdlib_data,
            run,
            **{
                "train.min_tokens_per_s": 1e12,
                "train.watchdog_steps": 6,
                "train.watchdog_action": "stop",
                "log.every": 3,
                "train.max_steps": 20,
                "ckpt.every": 0,
            },
        ),
    )
    assert code == 6, out + err
    line = next(line for line in (out + err).splitlines() if line.startswith("watchdog:"))
    assert "tokens/s < train.min_tokens_per_s" in line and "compile off" in line and "attention " in line
    assert "data wait" in line and "host syncs per step n/a" in line  # counted for the watchdog on CUDA only
    assert json.loads((run / "exit.json").read_text())["reason"] == "throughput_stop"
    # stopped at the check, with a checkpoint
    assert (run / "checkpoints" / "step-0000006" / "COMPLETE").is_file()
    records = read_metrics(run / "metrics.jsonl")
    assert all("data_wait_fraction" in r for r in records if "loss" in r)


def test_watchdog_passes_a_fast_enough_run(stdlib_data, tmp_path, run_cli):
    run = tmp_path / "run"
    code, out, err = run_cli(
        "train",
        *tiny_overrides(
            stdlib_data,
            run,
            **{
                "train.min_tokens_per_s": 1.0,
                "train.watchdog_steps": 4,
                "train.watchdog_action": "stop",
                "train.max_steps": 8,
            },
        ),
    )
    assert code == 0 and "watchdog: step 4: throughput ok" in out + err


def test_compiled_training_matches_eager_compiles_static_graphs_and_resumes_bit_exactly(
    text_data, tmp_path, monkeypatch
):
    """train.compile = true (each block compiled, activation checkpointing around it) against eager over
    8 steps, on a validation split whose last batch is short. Through dynamo and AOT autograd with the
    aot_eager backend: what is checked here (graphs, shapes, the compiled run's numbers and its resume)
    happens before inductor's code generation, whose C++ kernels cost a fresh machine ~47 CPU-s to
    compile for these few steps (inductor's GPU code is run by benchmarks/gpu_first_call.sh).
    - Static graphs: the step-0 evaluation used to compile the blocks at the short batch, training then
      recompiled them with the batch dimension dynamic, and a resumed run (no step-0 evaluation)
      compiled a static graph, other kernels; now torch's `dynamic` log makes no symbol.
    - Evaluation compiles its graphs once: later passes, training between them, the in-loop task
      scoring and the probes (which call the blocks with a KV cache, eagerly) add none.
    - A run resumed from the compiled run's step-4 checkpoint, compiling afresh as a new process
      would, continues it bit for bit."""
    import json
    import logging

    import torch._dynamo.utils

    from pretrainer.data.data_dir import open_data_dir
    from pretrainer.eval import inloop

    # the small text corpus: its whole validation split is a few dozen windows, evaluated each time
    windows = open_data_dir(text_data).sources("val", 64, "concat")[0][0].n_sequences
    micro_batch = next(m for m in (8, 7, 6, 5) if windows % m)
    settings = {
        "train.max_steps": 8,
        "eval.every": 2,
        "ckpt.every": 4,
        "log.every": 1,
        "train.micro_batch": micro_batch,
        "eval.batches": -(-windows // micro_batch),  # every window: the last batch is short
    }
    train(tiny_config(text_data, tmp_path / "eager", **settings))
    tasks = tmp_path / "toy.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"type": "mc", "context": f"x = {i}", "choices": [" 1", " 22"], "gold": 0}) + "\n"
            for i in range(4)
        )
    )
    graphs, symbols = [], []
    real = inloop.evaluate

    def counting(*args, **kwargs):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        result = real(*args, **kwargs)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return result

    class Symbols(logging.Handler):
        def emit(self, record):
            if "create_symbol" in record.getMessage():
                symbols.append(record.getMessage())

    monkeypatch.setattr(inloop, "evaluate", counting)
    monkeypatch.setenv("PRETRAINER_COMPILE_BACKEND", "aot_eager")
    compiled = {
        **settings,
        "train.compile": True,
        "train.activation_checkpointing": True,
        "eval.tasks_every": 2,
        "eval.tasks": str(tasks),
        "eval.probe_tokens": 2,
    }
    shapes_log, handler = logging.getLogger("torch.fx.experimental.symbolic_shapes"), Symbols()
    shapes_log.addHandler(handler)
    torch._logging.set_logs(dynamic=logging.INFO)
    try:
        torch._dynamo.reset()
        train(tiny_config(text_data, tmp_path / "compiled", **compiled))
        counted = list(graphs)
        torch._dynamo.reset()  # the resumed run compiles afresh, as a new process would
        step_4 = tmp_path / "compiled" / "checkpoints" / "step-0000004"
        train(tiny_config(text_data, tmp_path / "resumed", **compiled, **{"train.resume": step_4}))
    finally:
        torch._logging.set_logs()
        shapes_log.removeHandler(handler)
        torch._dynamo.reset()
    assert symbols == [], symbols[:3]
    eager, straight = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert eager.keys() == straight.keys() == set(range(1, 9))
    for step in eager:
        assert abs(eager[step] - straight[step]) < 2e-3, (step, eager[step], straight[step])
    # graphs: [before eval 0, after eval 0, before eval 2, after eval 2, ...]: eval 0 compiles the eval
    # graphs, step 1 the training graphs; from then on nothing new
    assert counted[1] > counted[0] and len(set(counted[3:])) == 1, counted
    numbers = lambda run: [  # noqa: E731
        (r["step"], key, r[key])
        for r in read_metrics(tmp_path / run / "metrics.jsonl")
        for key in ("loss", "grad_norm", "val_loss", "val_bpb")
        if key in r and r["step"] > 4
    ]
    assert numbers("compiled") == numbers("resumed") and len(numbers("resumed")) == 4 * 2 + 2 * 2
