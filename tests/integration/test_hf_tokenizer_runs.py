"""--tokenizer hf:DIR_OR_REPO: any Hugging Face tokenizer.json, made here with the `tokenizers` trainer
or exported by us, prepares, trains, samples and exports; ids are `tokenizers`' own; a vocab over
65,536 gives uint32 token files that train."""

import hashlib
import json

import numpy as np
import pytest
from helpers import DOCS, tiny_config
from support.hf_tokenizer_helpers import byte_level_bpe, documents_of
from tokenizers import Tokenizer as Backend

from pretrainer.data.prepare import prepare
from pretrainer.data.sources import Corpus
from pretrainer.data.tokenizers.load import load_tokenizer
from pretrainer.train.loop import train


@pytest.mark.parametrize("source", ["trainer", "our-export"])
def test_an_hf_tokenizer_prepares_trains_samples_and_exports(source, tmp_path, corpus, run_cli):
    from transformers import AutoTokenizer

    if source == "trainer":  # with a BOS, prepared by worker processes
        directory, workers = byte_level_bpe(tmp_path / "tok"), 2
    else:  # our own tokenizer.json (a trained bpe data dir's), no BOS
        directory, workers = tmp_path / "bpe", 1
        prepare(Corpus([str(corpus)]), "bpe:300", directory, val_fraction=0.2, seed=3, workers=1)
    data = tmp_path / "data"
    code, _, err = run_cli(
        "prepare",
        "--corpus",
        corpus,
        "--tokenizer",
        f"hf:{directory}",
        "--out",
        data,
        "--val-fraction",
        "0.2",
        "--seed",
        "3",
        "--workers",
        workers,
    )
    assert code == 0, err
    original = (directory / "tokenizer.json").read_bytes()
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["tokenizer"]["file_sha256"] == hashlib.sha256(original).hexdigest()
    assert (
        manifest["tokenizer"]["name"] == f"hf:{directory}"
        and (data / "tokenizer.json").read_bytes() == original
    )

    # every document is [BOS] + the library's own ids + EOT
    theirs = Backend.from_str(original.decode())
    tok = load_tokenizer(data)
    bos = [] if tok.bos_id is None else [tok.bos_id]
    expected = {tuple(bos + theirs.encode(d, add_special_tokens=False).ids + [tok.eot_id]) for d in DOCS}
    got = documents_of(data, "train") + documents_of(data, "val")
    assert len(got) == len(DOCS) and {tuple(d) for d in got} == expected
    assert (source == "trainer") == (tok.bos_id is not None)

    run = tmp_path / "run"
    train(
        tiny_config(data, run, **{"train.max_steps": 2, "eval.every": 2, "eval.batches": 1, "ckpt.every": 2})
    )
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == original
    code, out, err = run_cli(
        "sample", run, "--prompt", "def function_", "--max-new-tokens", "12", "--device", "cpu"
    )
    assert code == 0 and "--- sample 1 ---\ndef function_" in out, err
    code, _, err = run_cli("export", run, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == original  # unchanged
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def function_7(x):"
    # transformers' default is what the model was trained on
    assert exported.encode(text) == bos + tok.encode(text)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == ((bos or [tok.eot_id])[0], tok.eot_id)


def test_a_vocab_over_65536_makes_uint32_files_that_train(tmp_path, corpus, run_cli):
    """A tokenizer.json whose end-of-text is id 66,000 (BERT-style [unusedN] fillers before it)."""
    spec = json.loads(
        Backend.from_file(
            str(byte_level_bpe(tmp_path / "small", bos=False, vocab_size=300) / "tokenizer.json")
        ).to_str()
    )
    vocab = spec["model"]["vocab"]
    vocab.update({f"[unused{i}]": i for i in range(len(vocab), 66_000)})
    spec["added_tokens"].append(
        {
            "id": 66_000,
            "content": "<|endoftext|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "tokenizer.json").write_text(json.dumps(spec))
    data = tmp_path / "data"
    manifest = prepare(
        Corpus([str(corpus)]), f"hf:{tmp_path / 'big'}", data, val_fraction=0.2, seed=3, workers=1
    )
    assert manifest["tokenizer"]["vocab_size"] == 66_001 and manifest["tokenizer"]["eot_id"] == 66_000
    assert manifest["dtype"] == "uint32" and manifest["max_token_id"] == 66_000
    assert (data / "train-00000.bin").stat().st_size == 4 * manifest["splits"]["train"]["tokens"]
    run = tmp_path / "run"
    train(
        tiny_config(
            data,
            run,
            **{
                "model.d_model": 16,
                "model.n_head": 2,
                "model.n_kv_head": 1,
                "model.seq_len": 16,
                "train.micro_batch": 2,
                "train.max_steps": 2,
                "eval.every": 2,
                "eval.batches": 1,
                "ckpt.every": 2,
            },
        )
    )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_bpb" in m for m in metrics) and all(
        np.isfinite(m["loss"]) for m in metrics if "loss" in m
    )
    code, out, err = run_cli("sample", run, "--max-new-tokens", "5", "--device", "cpu")
    assert code == 0, err
