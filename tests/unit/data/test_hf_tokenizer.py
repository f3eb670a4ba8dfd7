"""--tokenizer hf:DIR_OR_REPO: any Hugging Face tokenizer.json, made here with the `tokenizers` trainer
or exported by us, prepares, trains, samples and exports; ids are `tokenizers`' own; a vocab over
65,536 gives uint32 token files that train."""

import hashlib
import json
import re
from pathlib import Path

import pytest
from helpers import DOCS
from support.hf_tokenizer_helpers import TEXTS, byte_level_bpe, documents_of
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pretrainer.core.errors import UserError
from pretrainer.data.data_dir import open_data_dir
from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.chat_format import (
    ASSISTANT_END,
    CHAT_TOKENS,
    USER_START,
    chat_tokenizer,
    render,
)
from pretrainer.data.tokenizers.hf import HFTokenizer, load_hf_tokenizer
from pretrainer.data.tokenizers.load import load_tokenizer


def sentencepiece_like(directory: Path) -> Path:
    """A Llama-2/Mistral-like tokenizer.json: Metaspace words, <0xNN> byte fallback, "<s> $A </s>"."""
    tok = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        DOCS + TEXTS, trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_like])
def test_ids_equal_the_tokenizers_librarys_own_encoding(make, tmp_path):
    directory = make(tmp_path / "tok")
    theirs = Backend.from_file(str(directory / "tokenizer.json"))
    ours = load_hf_tokenizer(f"hf:{directory}")
    source = Path(json.__file__).read_text()  # a real multi-kilobyte Python file
    texts = TEXTS + [source]
    expected = [theirs.encode(t, add_special_tokens=False).ids for t in texts]
    assert [ours.encode(t) for t in texts] == ours.encode_batch(texts) == expected
    assert ours.vocab_size == theirs.get_vocab_size(with_added_tokens=True)
    # EOT and BOS from the special tokens and the post-processor
    if make is byte_level_bpe:
        assert (ours.eot_name, ours.bos_name) == ("<|end_of_text|>", "<|begin_of_text|>") and (
            ours.eot_id,
            ours.bos_id,
        ) == (1, 0)
    else:
        assert (ours.eot_name, ours.bos_name) == ("</s>", "<s>")
    # a special token written in a document is text, never a separator
    assert ours.eot_id not in ours.encode("a" + ours.eot_name + "b")
    # bytes per token: exact for byte-level pieces; sentencepiece counts the "▁" its decoder drops at the
    # start
    lengths = ours.token_byte_lengths()
    for text, ids in zip(texts, expected):
        assert ours.decode(ids) == text or make is sentencepiece_like
        extra = 1 if make is sentencepiece_like and not text.startswith(" ") else 0
        assert sum(lengths[i] for i in ids) == len(text.encode()) + extra
    assert lengths[ours.eot_id] == lengths[ours.bos_id] == 0


def test_our_exported_tokenizer_json_read_back_gives_our_ids(tmp_path, corpus):
    """A data dir's tokenizer.json (ours, for Hugging Face) through --tokenizer hf:: the same tokens, byte
    for byte."""
    ours = tmp_path / "bpe"
    prepare(Corpus([str(corpus)]), "bpe:300", ours, val_fraction=0.2, seed=3, workers=1)
    again = tmp_path / "hf"
    manifest = prepare(Corpus([str(corpus)]), f"hf:{ours}", again, val_fraction=0.2, seed=3, workers=1)
    for split in ("train-00000.bin", "val-00000.bin"):
        assert (again / split).read_bytes() == (ours / split).read_bytes()
    tiktoken_kind, hf_kind = load_tokenizer(ours), load_tokenizer(again)
    assert (
        isinstance(hf_kind, HFTokenizer) and hf_kind.eot_id == tiktoken_kind.eot_id and hf_kind.bos_id is None
    )
    assert hf_kind.token_byte_lengths() == tiktoken_kind.token_byte_lengths()
    for text in TEXTS + ["<|endoftext|> is text here"]:
        assert hf_kind.encode(text) == tiktoken_kind.encode(text)
    assert (
        manifest["tokenizer"]["file_sha256"]
        == hashlib.sha256((ours / "tokenizer.json").read_bytes()).hexdigest()
    )
    assert (again / "tokenizer.json").read_bytes() == (ours / "tokenizer.json").read_bytes()


def test_chat_tokens_are_appended_after_an_hf_vocabulary(tmp_path):
    tok = load_hf_tokenizer(f"hf:{byte_level_bpe(tmp_path / 'tok')}")
    chat = chat_tokenizer(tok)
    assert [chat.special_tokens[n] for n in CHAT_TOKENS] == list(range(400, 400 + len(CHAT_TOKENS)))
    assert chat.vocab_size == 400 + len(CHAT_TOKENS) and chat.extends(tok) and not tok.extends(chat)
    assert chat_tokenizer(chat).sha256 == chat.sha256  # the tokens it has keep their ids
    ids, mask = render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}], chat
    )
    assert ids[-1] == chat.eot_id and ids[-2] == chat.special_tokens[ASSISTANT_END] and sum(mask) > 1
    assert chat.encode(USER_START) == tok.encode(USER_START)  # typed in a message: text
    chat.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.sha256 == chat.sha256 and again.special_tokens == chat.special_tokens
    assert (tmp_path / "saved" / "tokenizer.json").read_bytes() == (
        tmp_path / "tok" / "tokenizer.json"
    ).read_bytes()
    chat.write_hf_files(tmp_path / "saved")  # export: the chat tokens go into the exported tokenizer.json
    exported = Backend.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    assert all(exported.token_to_id(n) == chat.special_tokens[n] for n in CHAT_TOKENS)


def test_the_hub_cache_is_read_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--sometok"
    byte_level_bpe(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    tok = load_hf_tokenizer("hf:someorg/sometok")
    assert tok.name == "hf:someorg/sometok" and tok.eot_name == "<|end_of_text|>"
    with pytest.raises(
        UserError,
        match=r"hf:someorg/other: no local directory someorg/other, and tokenizer.json could not be "
        r"read from the local Hugging Face hub cache \(HF_HUB_OFFLINE is set\)",
    ):
        load_hf_tokenizer("hf:someorg/other")


def _no_eot(directory: Path) -> None:
    tok = Backend(models.WordLevel({"a": 0, "<unk>": 1, "<pad>": 2}, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>"])
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (lambda d: None, [], "tok not found; give a directory holding tokenizer.json or a hub repo id"),
        (
            lambda d: d.mkdir(),
            [],
            "tok/tokenizer.json: not found; --tokenizer hf:DIR needs a directory holding a Hugging Face "
            "tokenizer.json",
        ),
        (
            lambda d: (d.mkdir(), (d / "tokenizer.json").write_text("{not json")),
            [],
            "tok/tokenizer.json: not a valid Hugging Face tokenizer.json",
        ),
        (
            _no_eot,
            [],
            r"tok/tokenizer.json: no end-of-text token found among its special tokens \(<pad>\); pass "
            r"--eot-token NAME",
        ),
        (
            byte_level_bpe,
            ["--eot-token", "<eos>"],
            r"--eot-token <eos>: not a special token of .*tok/tokenizer.json; its special tokens: "
            r"<\|begin_of_text\|>",
        ),
    ],
)
def test_bad_hf_tokenizers_give_one_line(make, extra, message, tmp_path, corpus, run_cli):
    directory = tmp_path / "tok"
    make(directory)
    code, out, err = run_cli(
        "prepare", "--corpus", corpus, "--tokenizer", f"hf:{directory}", *extra, "--out", tmp_path / "data"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "data").exists()


def test_eot_token_picks_the_separator_and_is_only_for_hf(tmp_path, corpus, run_cli):
    _no_eot(tmp_path / "tok")
    tok = load_hf_tokenizer(f"hf:{tmp_path / 'tok'}", eot_token="<pad>")
    assert (tok.eot_name, tok.eot_id, tok.bos_id) == ("<pad>", 2, None)
    code, _, err = run_cli(
        "prepare",
        "--corpus",
        corpus,
        "--tokenizer",
        "bpe:300",
        "--eot-token",
        "<pad>",
        "--out",
        tmp_path / "d",
    )
    assert code == 2 and "--eot-token <pad>: only with --tokenizer hf:DIR_OR_REPO" in err


def test_a_changed_tokenizer_json_is_refused(tmp_path, corpus):
    data = tmp_path / "data"
    prepare(
        Corpus([str(corpus)]), f"hf:{byte_level_bpe(tmp_path / 'tok')}", data, val_fraction=0.2, workers=1
    )
    spec = json.loads((data / "tokenizer.json").read_text())
    (data / "tokenizer.json").write_text(json.dumps(spec))  # the same tokenizer, other bytes: still refused
    with pytest.raises(
        UserError, match="tokenizer.json: does not match the sha256 in pretrainer-tokenizer.json"
    ):
        open_data_dir(data)


def test_a_streamed_document_gets_one_bos(tmp_path, monkeypatch):
    """A document read in pieces, its pieces spread over several batches: BOS before the first only."""
    from pretrainer.data import encoding, sources

    monkeypatch.setattr(sources, "PIECE_BYTES", 200)
    monkeypatch.setattr(encoding, "BATCH_CHARS", 300)
    (tmp_path / "corpus").mkdir()
    big = "".join(DOCS[:30])
    (tmp_path / "corpus" / "big.txt").write_text(big)
    for i, doc in enumerate(DOCS[30:40]):
        (tmp_path / "corpus" / f"small{i}.txt").write_text(doc)
    directory = byte_level_bpe(tmp_path / "tok")
    prepare(
        Corpus([str(tmp_path / "corpus")], txt_docs="file"),
        f"hf:{directory}",
        tmp_path / "data",
        val_fraction=0.3,
        workers=1,
    )
    docs = documents_of(tmp_path / "data", "train") + documents_of(tmp_path / "data", "val")
    assert len(docs) == 11 and all(d[0] == 0 and d.count(0) == 1 for d in docs)  # <|begin_of_text|> = 0
    assert any(
        d[1:-1]
        == Backend.from_file(str(directory / "tokenizer.json")).encode(big, add_special_tokens=False).ids
        for d in docs
    )


def test_the_files_truncation_and_padding_are_off_and_an_ordinary_token_cannot_end_documents(tmp_path):
    """A tokenizer.json saved with truncation and padding on (sentence-transformers exports often are)
    would cut and pad every document; the file stays byte for byte, its settings are not applied."""
    directory = byte_level_bpe(tmp_path / "tok")
    plain = Backend.from_file(str(directory / "tokenizer.json"))
    saved = Backend.from_file(str(directory / "tokenizer.json"))
    saved.enable_truncation(max_length=3)
    saved.enable_padding(length=64)
    saved.save(str(directory / "tokenizer.json"))
    tok = load_hf_tokenizer(f"hf:{directory}")
    expected = plain.encode(DOCS[7], add_special_tokens=False).ids
    assert len(expected) > 3 and tok.encode(DOCS[7]) == expected and tok.encode_batch([DOCS[7]]) == [expected]
    # the template, not the padding
    assert (tok.eot_name, tok.bos_name) == ("<|end_of_text|>", "<|begin_of_text|>")
    assert tok.data == (directory / "tokenizer.json").read_bytes()
    ordinary = plain.id_to_token(300)
    with pytest.raises(UserError, match=f"--eot-token {re.escape(ordinary)}: not a special token of"):
        load_hf_tokenizer(f"hf:{directory}", eot_token=ordinary)
