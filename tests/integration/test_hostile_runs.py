"""What a careless user, a double-submitting scheduler or a full disk does to a run: each case ends in
one line (exit 2) or the right behaviour, and nothing already saved is lost."""

from __future__ import annotations

import pytest
from helpers import tiny_overrides


@pytest.mark.parametrize("shape", [{"model.d_model": 1_000_000}, {"model.seq_len": 100_000_000}])
def test_a_shape_that_cannot_fit_is_refused_before_allocation(stdlib_data, tmp_path, run_cli, shape):
    run = tmp_path / "run"
    code, out, err = run_cli("train", *tiny_overrides(stdlib_data, run, **shape))
    assert code == 2, out + err
    assert err.count("\n") == 1 and err.startswith("error: config: this run needs about"), err
    assert "`pretrainer plan` itemises it" in err
    assert not run.exists(), "a run refused before its first write leaves nothing"
