"""Two gloo ranks, each block compiled, in bf16 autocast (DDP and FSDP2), against one process in fp32."""

import pytest
from helpers import losses, tiny_config, tiny_overrides, train_ranks

from pretrainer.train.loop import train

TWO_RANKS = {"train.max_steps": 8, "train.micro_batch": 4, "eval.every": 4, "ckpt.every": 4, "log.every": 2}


@pytest.fixture(scope="module")
def one_process_fp32(stdlib_data, tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("single") / "run"
    train(tiny_config(stdlib_data, run, **{**TWO_RANKS, "train.grad_accum": 2}))
    return losses(run)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_compiled_in_bf16_match_one_process_in_fp32(
    strategy, one_process_fp32, stdlib_data, tmp_path, monkeypatch
):
    """Two ranks (gloo), each block compiled, bf16 autocast (FSDP: MixedPrecisionPolicy with bf16
    all-gathers and fp32 reduce-scatters), against one process with the same batch in fp32 eager.
    (Compiled fp32 against eager fp32 is checked tightly in one process above; no host sync under
    two ranks in tests/test_distributed.py.)
    Through dynamo and AOT autograd without inductor's code generation (aot_eager): what composes with
    DDP and FSDP2 is the tracing; inductor's CPU kernels, cold-compiled by two ranks at once on two cores,
    took ~35 s of a fresh clone's suite (inductor itself is tested in test_gpu_ready_runs.py)."""
    monkeypatch.setenv("PRETRAINER_COMPILE_BACKEND", "aot_eager")
    run = tmp_path / "run"
    out = train_ranks(
        2,
        *tiny_overrides(
            stdlib_data,
            run,
            **TWO_RANKS,
            **{"parallel.strategy": strategy, "train.compile": True, "train.dtype": "bfloat16"},
        ),
    )
    assert "bf16 autocast" in out.stdout and "compiled per block" in out.stdout
    two_ranks = losses(run)
    assert two_ranks.keys() == one_process_fp32.keys() == {2, 4, 6, 8}
    # bf16 keeps ~3 significant digits; over 8 steps the losses stay within a few hundredths
    for step in two_ranks:
        assert abs(two_ranks[step] - one_process_fp32[step]) < 5e-2, (
            step,
            two_ranks[step],
            one_process_fp32[step],
        )
