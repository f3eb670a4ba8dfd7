"""2-rank CPU training with gloo (forked ranks: helpers.train_ranks), checked against single-process runs;
a collective that one rank never joins times out (under torchrun)."""

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    _cli_train,
    losses,
    rank_envs,
    run_forked,
    run_in_ranks,
    tiny_config,
    tiny_overrides,
    train_ranks,
)
from safetensors.torch import load_file

from pretrainer.artifacts.checkpoint import latest_checkpoint
from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.errors import UserError
from pretrainer.train.loop import train

STEPS = 20


def assert_same_run(a: Path, b: Path) -> None:
    la, lb = losses(a), losses(b)
    assert list(la) == list(range(1, STEPS + 1)) and la.keys() == lb.keys()
    for step in la:
        assert abs(la[step] - lb[step]) < 1e-5, (step, la[step], lb[step])
    wa, wb = (load_file(latest_checkpoint(r) / "model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert (wa[key] - wb[key]).abs().max().item() < 1e-5, key


def settings(**extra) -> dict:
    return {
        "train.max_steps": STEPS,
        "train.micro_batch": 4,
        "eval.every": 10,
        "ckpt.every": 10,
        "log.sequences": True,
        **extra,
    }


@pytest.fixture(scope="module")
def in_loop_evals(tmp_path_factory) -> dict:
    """in-loop tasks and probes every 10 steps (a KV-cache prefill and decode through DDP and
    FSDP2)."""
    path = tmp_path_factory.mktemp("tasks") / "toy.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"type": "mc", "context": f"x = {i} +", "choices": [" 1", " 22", " 333"], "gold": i % 3}
            )
            + "\n"
            for i in range(9)
        )
    )
    return {"eval.tasks_every": 10, "eval.tasks": str(path), "eval.probe_tokens": 4}


@pytest.fixture(scope="module")
def single(stdlib_data, tmp_path_factory, in_loop_evals) -> Path:
    """One process, micro-batch 4 x grad_accum 2: the reference for every 2-rank run."""
    run = tmp_path_factory.mktemp("single") / "run"
    train(tiny_config(stdlib_data, run, **settings(**{"train.grad_accum": 2}, **in_loop_evals)))
    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_with_grad_accum(strategy, single, stdlib_data, tmp_path, in_loop_evals):
    run = tmp_path / "run"
    # logging every 4th step, with the host-sync audit on the 3 steps between (none may sync)
    out = train_ranks(
        2,
        *tiny_overrides(
            stdlib_data,
            run,
            **settings(
                **{"parallel.strategy": strategy, "log.every": 4, "train.audit_syncs": True}, **in_loop_evals
            ),
        ),
    )
    assert "tokens per step: 512 = 4 micro-batch x 64 seq_len x 1 grad_accum x 2 ranks" in out.stdout
    two_ranks, one = losses(run), losses(single)
    assert list(two_ranks) == list(range(4, STEPS + 1, 4))
    for step in two_ranks:
        assert abs(two_ranks[step] - one[step]) < 1e-5, (step, two_ranks[step], one[step])
    wa, wb = (load_file(latest_checkpoint(r) / "model.safetensors") for r in (run, single))
    assert wa.keys() == wb.keys() and all((wa[key] - wb[key]).abs().max().item() < 1e-5 for key in wa)
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["tokens"] for r in records] == [512 * s for s in range(4, STEPS + 1, 4)]
    assert [r["host_syncs_per_step"] for r in records] == [0.0] * len(records)
    suite = [
        {k: v for k, v in r.items() if k not in ("elapsed_s", "tasks_eval_s")}
        for r in read_metrics(run / "metrics.jsonl")
        if "suite_score" in r
    ]
    assert [r["step"] for r in suite] == [0, 10, 20] and suite == [
        {k: v for k, v in r.items() if k not in ("elapsed_s", "tasks_eval_s")}
        for r in read_metrics(single / "metrics.jsonl")
        if "suite_score" in r
    ]
    # rank 0 writes, greedy alike
    assert read_metrics(run / "probes.jsonl") == read_metrics(single / "probes.jsonl")


@pytest.fixture(scope="module")
def single_muon(stdlib_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("single-muon") / "run"
    train(tiny_config(stdlib_data, run, **settings(**{"train.grad_accum": 2, "optim.name": "muon"})))
    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_muon_equal_one_process(strategy, single_muon, stdlib_data, tmp_path):
    """Muon orthogonalises whole matrices: under FSDP2 each rank gathers the momentum of its row shard,
    orthogonalises the whole and keeps its rows, so two ranks equal one process as AdamW's do."""
    run = tmp_path / "run"
    train_ranks(
        2,
        *tiny_overrides(
            stdlib_data, run, **settings(**{"parallel.strategy": strategy, "optim.name": "muon"})
        ),
    )
    assert_same_run(run, single_muon)


def test_fsdp_over_two_nodes_shards_within_each_node_and_equals_one_process(single, stdlib_data, tmp_path):
    """4 ranks as 2 nodes x 2 (torchrun's LOCAL_WORLD_SIZE), 2 micro-steps: FSDP2 shards within a node and
    replicates across nodes (HSDP), so no all-gather crosses the network, and all-reduces between the
    replicas once per step; the losses are one process's. (Its first half: 4 ranks on 2 cores are the
    module's dearest steps; the schedule stays STEPS'.)"""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    envs = [
        {**env, "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}
        for rank, env in enumerate(rank_envs(4, port))
    ]
    run = tmp_path / "run"
    args = tiny_overrides(
        stdlib_data,
        run,
        **settings(
            **{"parallel.strategy": "fsdp", "train.micro_batch": 1, "train.grad_accum": 2, "eval.every": 0},
            **{"train.stop_at_step": STEPS // 2},
        ),
    )
    result = run_forked(_cli_train, [str(a) for a in args], envs=envs, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "hsdp (2 replicas x 2 shards)" in result.stdout
    four_ranks, one = losses(run), losses(single)
    assert list(four_ranks) == list(range(1, STEPS // 2 + 1))
    for step in four_ranks:
        assert abs(four_ranks[step] - one[step]) < 1e-5, (step, four_ranks[step], one[step])


def sequences_seen(run: Path) -> Counter:
    seen = Counter()
    for path in run.glob("sequences-rank*.jsonl"):
        for record in read_metrics(path):
            seen.update(record["ids"])
    return seen


@pytest.mark.parametrize("first, then", [("fsdp", "single"), ("single", "ddp")])
def test_checkpoint_moves_between_strategies_and_world_sizes(first, then, single, stdlib_data, tmp_path):
    run = tmp_path / "run"
    one_process = {"train.grad_accum": 2}
    # the saved config has 2
    two_ranks = lambda strategy: {"parallel.strategy": strategy, "train.grad_accum": 1}
    for phase, stop in ((first, {"train.stop_at_step": 10}), (then, {})):
        if phase == "single":
            train(tiny_config(stdlib_data, run, **settings(**one_process, **stop)))
        else:
            train_ranks(2, *tiny_overrides(stdlib_data, run, **settings(**two_ranks(phase), **stop)))
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())
    assert state["step"] == STEPS and state["tokens"] == STEPS * 512
    assert_same_run(run, single)
    assert sequences_seen(run) == sequences_seen(single)  # nothing re-seen, nothing skipped
    assert sum(sequences_seen(run).values()) == STEPS * 8


def _collective_rank_1_never_joins() -> int:
    from pretrainer.core.end_reasons import is_collective_timeout
    from pretrainer.train.distributed import init_distributed, mean_across_ranks

    env = init_distributed("cpu", timeout_s=2)
    if env.rank == 1:
        time.sleep(4)  # past rank 0's timeout
        return 0
    try:
        mean_across_ranks(torch.ones(()), env)  # a deadlock without the timeout
    except Exception as e:
        print("TIMEOUT" if is_collective_timeout(e) else repr(e), flush=True)
    return 0


def test_a_rank_dependent_collective_times_out_instead_of_hanging():
    result = run_in_ranks(2, _collective_rank_1_never_joins, timeout=60)
    assert "TIMEOUT" in result.stdout, result.stdout[-2000:]


class CountingModel(torch.nn.Module):
    """A bigram model that counts its forwards (the trainer's forward signature)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.logits = torch.nn.Embedding(16, 16)
        self.forwards = 0

    def forward(self, x, y, per_token=False, doc_separator=None):
        self.forwards += 1
        losses = torch.nn.functional.cross_entropy(
            self.logits(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none"
        ).view_as(y)
        return losses, losses.sum() / (y != -100).sum()


def validation_batches_for_test() -> list:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 16, (2, 8), generator=generator),) * 2 for _ in range(5)]
    batches = [(x, torch.roll(y, 1, 1)) for x, y in batches]
    batches[3][1][0, :4] = -100  # a loss mask: these targets count nowhere
    return batches


def _validate_in_rank() -> int:
    import torch.distributed as dist

    from pretrainer.eval.loss import evaluate

    dist.init_process_group("gloo")
    model = CountingModel()
    scores = evaluate(model, validation_batches_for_test(), torch.device("cpu"), None, torch.arange(16) % 3)
    print(json.dumps({"rank": dist.get_rank(), "forwards": model.forwards, **scores}), flush=True)
    dist.destroy_process_group()
    return 0


def test_validation_splits_its_batches_across_ranks():
    """Two ranks score 5 batches as 3 forwards each (one re-scored with weight 0, as FSDP2's all-gathers
    need equal counts), and agree with one process on all 5."""
    from pretrainer.eval.loss import evaluate

    one = evaluate(
        CountingModel(), validation_batches_for_test(), torch.device("cpu"), None, torch.arange(16) % 3
    )
    result = run_in_ranks(2, _validate_in_rank, timeout=60)
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and sorted(r["rank"] for r in ranks) == [0, 1], result.stdout[-2000:]
    assert [r["forwards"] for r in ranks] == [3, 3]
    for r in ranks:
        assert r["val_loss"] == pytest.approx(one["val_loss"], rel=1e-12)
        assert r["val_bpb"] == pytest.approx(one["val_bpb"], rel=1e-12)


def _rng_round_trip_in_rank() -> int:
    """Seeded alike, each rank draws as many numbers as its rank + 1 (dropout on its own data), saves every
    rank's state as write_checkpoint does, loses it, and restores the state resume gives this rank."""
    import random

    import numpy as np

    from pretrainer.train.checkpoint import rank_rng_state, rng_state, set_rng_state
    from pretrainer.train.distributed import gather_objects, init_distributed

    env = init_distributed("cpu", 60)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    torch.rand(env.rank + 1), np.random.rand(env.rank + 1), [random.random() for _ in range(env.rank + 1)]
    saved = {"rng": rng_state(), "rng_ranks": gather_objects(rng_state(), env)}
    expected = [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    set_rng_state(rank_rng_state(saved, env.rank, env.world_size))
    got = [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]
    print(json.dumps({"rank": env.rank, "same": got == expected}), flush=True)
    return 0


def test_each_rank_resumes_its_own_rng_state():
    result = run_in_ranks(2, _rng_round_trip_in_rank, timeout=60)
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["rank"], r["same"]) for r in ranks) == [(0, True), (1, True)], result.stdout[-2000:]


def _checkpoint_with_a_rank_gone(run_dir: str) -> int:
    """Rank 1's collectives have failed (an aborted NCCL communicator): it never joins another one.
    Rank 0 reaches a checkpoint with nothing in the way of writing it."""
    import datetime

    import torch.distributed as dist

    from pretrainer.config.load import load_config
    from pretrainer.config.resolve import resolve_d_ff
    from pretrainer.model import Transformer
    from pretrainer.train.checkpoint import rng_state, write_checkpoint
    from pretrainer.train.distributed import gather_objects, init_distributed

    env = init_distributed("cpu", 1)
    # as on CUDA: the loop's flags on a separate gloo group, which outlives an aborted NCCL communicator
    env.control_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    if env.rank == 1:  # still answers on the control group, never again on the gradients' group
        gather_objects(rng_state(), env)
        time.sleep(2.5)  # past rank 0's timeout
        return 0
    cfg = load_config(None, ["--model.vocab_size=64", "--model.n_layer=1", "--model.d_model=32"])
    cfg.model.d_ff = resolve_d_ff(cfg.model)
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        write_checkpoint(
            Path(run_dir), 5, model, model, optimizer, keep=2, env=env, trainer_state=lambda: {"step": 5}
        )
    except Exception as e:
        print(f"REFUSED {type(e).__name__}", flush=True)
    return 0


def test_no_checkpoint_after_a_failed_collective(tmp_path):
    result = run_in_ranks(2, _checkpoint_with_a_rank_gone, str(tmp_path), timeout=60)
    assert "REFUSED" in result.stdout, result.stdout[-2000:]
    assert latest_checkpoint(tmp_path) is None and not list(tmp_path.glob("**/*.safetensors"))


def _fsdp_gradient_bytes_between_micro_steps() -> int:
    """FSDP2 on 2 ranks, the first of 2 micro-steps: the gradient bytes each rank holds then, against
    what plan counts for gradients (4 bytes per parameter / 2 shards)."""
    from pretrainer.config.load import load_config
    from pretrainer.config.resolve import resolve_d_ff
    from pretrainer.core.device import tensor_bytes
    from pretrainer.model import Transformer
    from pretrainer.train.distributed import gradient_sync, init_distributed, wrap_model
    from pretrainer.train.memory import planned_memory

    env = init_distributed("cpu", 30)
    cfg = load_config(None, ["--model.vocab_size=64", "--model.n_layer=2", "--model.d_model=32"])
    cfg.parallel.strategy, cfg.model.d_ff = "fsdp", resolve_d_ff(cfg.model)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    wrapped = wrap_model(model, "fsdp", env, None)
    ids = torch.randint(0, 64, (2, 17))
    with gradient_sync(wrapped, "fsdp", env, sync=False):  # what the loop does before the last micro-step
        wrapped(ids[:, :-1], ids[:, 1:])[1].backward()
    held = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    planned = planned_memory(cfg, env.world_size)[1]["gradients"]
    print(json.dumps({"rank": env.rank, "held": held, "planned": planned}), flush=True)
    return 0


def test_fsdp_holds_gradient_shards_between_micro_steps_as_plan_counts():
    """Not a full unsharded fp32 gradient per GPU while gradient accumulation goes on (+4 bytes per
    parameter that plan did not count)."""
    result = run_in_ranks(2, _fsdp_gradient_bytes_between_micro_steps, timeout=60)
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, result.stdout[-2000:]
    for rank in ranks:
        assert 0.95 * rank["planned"] <= rank["held"] <= 1.05 * rank["planned"], rank


def _train_on_a_slow_disk(args: list[str]) -> int:
    """Rank 0's checkpoint writes take 4 s (a slow network filesystem); the hang timeout is 2 s."""
    from helpers import _cli_train

    from pretrainer.artifacts import checkpoint

    real = checkpoint._write_checkpoint_dir

    def slow(*a, **kw):
        time.sleep(4)
        return real(*a, **kw)

    checkpoint._write_checkpoint_dir = slow
    return _cli_train(args)


def test_a_slow_checkpoint_write_is_not_a_hang(stdlib_data, tmp_path):
    """The other ranks wait for rank 0's write up to ckpt.write_timeout_s, not the hang timeout
    (parallel.timeout_s), which would end the run as exit 3 at every checkpoint a slow disk delays."""
    run = tmp_path / "run"
    args = tiny_overrides(
        stdlib_data,
        run,
        **{
            "train.max_steps": 4,
            "ckpt.every": 0,
            "eval.every": 0,
            "parallel.timeout_s": 2,
            "train.micro_batch": 4,
        },
    )
    result = run_in_ranks(2, _train_on_a_slow_disk, [str(a) for a in args], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert json.loads((run / "exit.json").read_text())["reason"] == "finished"
    assert latest_checkpoint(run).name == "step-0000004"


def test_global_batch_must_divide_by_micro_batch_times_world(stdlib_data, tmp_path):
    with pytest.raises(
        UserError, match=r"train.global_batch = 10 is not divisible by train.micro_batch x world size = 4 x 1"
    ):
        train(
            tiny_config(stdlib_data, tmp_path / "run", **{"train.micro_batch": 4, "train.global_batch": 10})
        )
    result = train(
        tiny_config(
            stdlib_data,
            tmp_path / "ok",
            **{"train.micro_batch": 4, "train.global_batch": 12, "train.max_steps": 2},
        )
    )
    assert result["tokens"] == 2 * 12 * 64


def test_gloo_takes_nccls_interfaces_only_where_they_are_exact_names(monkeypatch):
    """NCCL_SOCKET_IFNAME=lo: gloo's groups use lo too; a prefix (NCCL's "eth" matches eth0) or an
    exclusion ("^docker") is not a name gloo can use, so gloo keeps its own default."""
    from pretrainer.train.distributed import default_gloo_interfaces

    for given, expected in (("lo", "lo"), ("no-such-if", None), ("^docker,lo", None), ("", None)):
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
        default_gloo_interfaces(given)
        assert os.environ.get("GLOO_SOCKET_IFNAME") == expected, given
