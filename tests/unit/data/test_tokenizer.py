import json
import os

import pytest

from pretrainer.core.errors import UserError
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.base import EOT, METADATA_FILE
from pretrainer.data.tokenizers.bpe import GPT2_VOCAB_SIZE, load_gpt2, train_bpe
from pretrainer.data.tokenizers.load import load_tokenizer

SAMPLES = [
    "Hello world",
    "def main(argv):\n\treturn 0\n",
    "naïve café — 日本語 🙂",
    "   leading spaces\n\n\n",
    "<|endoftext|> is text here",
]


def test_gpt2_matches_published_ids():
    tok = load_gpt2()  # offline: the ranks file fetched by `make setup`
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == GPT2_VOCAB_SIZE and tok.eot_id == 50256
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_gpt2_rejects_a_tampered_ranks_file(tmp_path, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(b"SGVsbG8= 0\n")
    monkeypatch.setenv("PRETRAINER_GPT2_RANKS", str(bad))
    with pytest.raises(UserError, match="sha256 does not match"):
        load_gpt2()


@pytest.fixture(scope="module")
def trained():
    docs = Corpus(["stdlib"]).documents()
    return train_bpe((next(docs) for _ in range(150)), 700)


def test_trained_bpe_round_trips_and_compresses(trained):
    assert trained.vocab_size == 700 and trained.eot_id == 699
    for text in SAMPLES:
        assert trained.decode(trained.encode(text)) == text
    code = "import os\n\ndef main():\n    return os.path.join('a', 'b')\n"
    assert len(trained.encode(code)) < len(code.encode()) / 2  # merges learned from Python source


def test_trained_bpe_saves_and_reloads_identically(trained, tmp_path):
    trained.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert (
        again.sha256 == trained.sha256 and again.ranks == trained.ranks and again.pattern == trained.pattern
    )
    for text in SAMPLES:
        assert again.encode(text) == trained.encode(text)


def test_tampered_tokenizer_files_are_rejected(trained, tmp_path):
    trained.save(tmp_path)
    meta = json.loads((tmp_path / METADATA_FILE).read_text())
    meta["pattern"] = r"\w+"
    (tmp_path / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(UserError, match="does not match the sha256"):
        load_tokenizer(tmp_path)


def test_saved_directory_loads_in_transformers_and_encodes_like_ours(trained, tmp_path):
    from transformers import AutoTokenizer

    trained.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES[:-1]:
        ids = trained.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs.decode(ids) == text
    assert theirs.eos_token == EOT and theirs.eos_token_id == trained.eot_id
    # A literal "<|endoftext|>" is the special token to Hugging Face (its convention), plain text to
    # us (encode_ordinary); split_special_tokens=True gives ours.
    text = "a" + EOT + "b"
    assert theirs.encode(text, add_special_tokens=False) == trained.encode("a") + [
        trained.eot_id
    ] + trained.encode("b")
    as_text = AutoTokenizer.from_pretrained(tmp_path, split_special_tokens=True)
    assert as_text.encode(text, add_special_tokens=False) == trained.encode(text)


def test_directories_written_before_the_hugging_face_files_still_load(trained, tmp_path):
    """Older versions wrote our metadata as tokenizer.json, beside tokenizer.tiktoken and nothing else."""
    trained.save(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    os.replace(tmp_path / METADATA_FILE, tmp_path / "tokenizer.json")
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json", "tokenizer.tiktoken"]
    assert set(json.loads((tmp_path / "tokenizer.json").read_text())) == {
        "name",
        "pattern",
        "special_tokens",
        "vocab_size",
        "sha256",
    }
    again = load_tokenizer(tmp_path)
    assert again.sha256 == trained.sha256 and again.encode(SAMPLES[1]) == trained.encode(SAMPLES[1])


def test_a_saved_tokenizer_is_recognised_only_when_complete_and_the_same(tmp_path):
    """A resumed run skips rewriting its tokenizer only when every file is there for this tokenizer."""
    tok = train_bpe(iter(["def f(x):\n    return x * 2\n"] * 50), 265)
    assert not tok.is_saved_in(tmp_path / "tok")
    tok.save(tmp_path / "tok")
    assert tok.is_saved_in(tmp_path / "tok")
    other = train_bpe(iter(["other text entirely, with words\n"] * 50), 265)
    assert not other.is_saved_in(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()  # an older layout, or a torn write
    assert not tok.is_saved_in(tmp_path / "tok")
