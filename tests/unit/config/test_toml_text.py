"""config/toml_text writes what tomli-w writes for every shipped config, and whatever it writes tomllib
reads back as the same values (strings with any character, floats at the edges, lists, tables)."""

import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pretrainer.config.keys import config_text, to_dict
from pretrainer.config.load import load_config
from pretrainer.config.toml_text import toml_document

# training configs (a sweep's file has its own [sweep] section)
CONFIGS = [
    p
    for p in sorted((Path(__file__).parents[3] / "configs").glob("*.toml"))
    if "[sweep]" not in p.read_text()
]


@pytest.mark.parametrize("mixture", [False, True])
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_written_as_tomli_w_writes_it(path, mixture):
    tomli_w = pytest.importorskip("tomli_w")  # a dev dependency: the reference
    cfg = load_config(path)
    if mixture:  # a list of tables
        cfg.data.dir, cfg.data.mixture = "", [{"dir": "a", "weight": 0.7}, {"dir": "b c", "weight": 0.3}]
    assert config_text(cfg) == tomli_w.dumps(to_dict(cfg))
    assert tomllib.loads(config_text(cfg)) == to_dict(cfg)


scalars = st.one_of(
    st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(allow_nan=False), st.text()
)
names = st.text(min_size=1, max_size=12)
values = st.one_of(
    scalars, st.lists(scalars, max_size=4), st.lists(st.dictionaries(names, scalars, max_size=3), max_size=3)
)


@given(st.dictionaries(names, st.dictionaries(names, values, max_size=5), max_size=4))
def test_anything_written_reads_back_the_same(document):
    assert tomllib.loads(toml_document(document)) == document


def test_nan_and_infinities_read_back():
    read = tomllib.loads(toml_document({"s": {"a": math.inf, "b": -math.inf, "c": math.nan}}))["s"]
    assert read["a"] == math.inf and read["b"] == -math.inf and math.isnan(read["c"])
