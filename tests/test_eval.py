"""Issue 14: is the model any good? Bits per byte: nats of the scored tokens over the UTF-8 bytes
of exactly the text they stand for, so models with different tokenizers compare."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrainer.config import ModelConfig
from pretrainer.data.tokenizer import Tokenizer, load_gpt2, train_bpe
from pretrainer.eval.loss import evaluate, token_bytes_tensor
from pretrainer.model import Transformer

TEXTS = ["naïve café — crème brûlée, 日本語のテキスト, emoji 😀🎉 and ascii words " * 3 + f"doc {i}" for i in range(60)]


def bpe() -> Tokenizer:
    return train_bpe(iter(TEXTS), 300)


def gpt2() -> Tokenizer:
    try:
        return load_gpt2()
    except Exception as e:  # noqa: BLE001 (no ranks: `make setup` fetches them)
        pytest.skip(f"GPT-2 ranks not available: {e}")


@pytest.mark.parametrize("make_tokenizer", [bpe, gpt2], ids=["bpe", "gpt2"])
def test_token_bytes_are_the_utf8_bytes_of_exactly_the_scored_text(make_tokenizer):
    tok = make_tokenizer()
    lengths = tok.token_byte_lengths()
    doc_a, doc_b = TEXTS[0], TEXTS[1]
    ids = tok.encode(doc_a) + [tok.eot_id] + tok.encode(doc_b)
    assert sum(lengths[i] for i in ids) == len(doc_a.encode()) + len(doc_b.encode())  # the separator has no bytes
    pieces = [tok.encoding.decode_single_token_bytes(i) if i != tok.eot_id else b"" for i in ids]
    split_chars = 0
    for start in range(0, len(ids), 7):  # spans cut anywhere: mid-document, mid-character
        for end in range(start + 1, len(ids) + 1, 11):
            assert sum(lengths[i] for i in ids[start:end]) == len(b"".join(pieces[start:end]))
    for piece in pieces:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            split_chars += 1
    assert split_chars > 0  # some token holds part of a multi-byte character: its bytes still count exactly


def test_bits_per_byte_by_hand():
    tok = bpe()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size + 4, seq_len=32, d_model=32, n_layer=2, n_head=2))  # padded
    stream = []
    for text in TEXTS[:6]:
        stream += tok.encode(text) + [tok.eot_id]
    windows = torch.tensor(stream[: 4 * 33]).view(4, 33)
    batches = [(windows[:2, :-1], windows[:2, 1:]), (windows[2:, :-1], windows[2:, 1:])]
    scores = evaluate(model, batches, torch.device("cpu"), None, token_bytes_tensor(tok, model.cfg.vocab_size))

    nats, n_bytes, all_nats, n_tokens = 0.0, 0, 0.0, 0
    for x, y in batches:  # plain reference: full logits, per-token cross-entropy, bytes from the ranks
        with torch.no_grad():
            logits, _ = model(x)
        losses = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="none")
        for loss, target in zip(losses.tolist(), y.flatten().tolist()):
            all_nats, n_tokens = all_nats + loss, n_tokens + 1
            if target != tok.eot_id:  # the separator stands for no text
                nats += loss
                n_bytes += len(tok.encoding.decode_single_token_bytes(target))
    assert n_bytes > n_tokens  # multi-byte tokens: bytes and tokens differ
    assert scores["val_bpb"] == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)
    assert scores["val_loss"] == pytest.approx(all_nats / n_tokens, rel=1e-5)


# --- in-context tasks: multiple choice, schema, language modelling ---

def marked_items(n: int, rng) -> list[dict]:
    """Items whose correct option says RIGHT, the others wrong (a scorer can tell them apart)."""
    items = []
    for i in range(n):
        gold = rng.randrange(4)
        kind = ("mc", "schema", "lm")[i % 3]
        if kind == "mc":
            items.append({"type": "mc", "context": f"Question {i}:", "gold": gold,
                          "choices": [" RIGHT" if c == gold else f" wrng{c}" for c in range(4)]})  # same lengths
        elif kind == "schema":
            items.append({"type": "schema", "contexts": ["RIGHT here" if c == gold % 2 else "wrong here" for c in range(2)],
                          "continuation": " then", "gold": gold % 2})
        else:
            items.append({"type": "lm", "context": f"Say {i}:", "continuation": " RIGHT"})
    return items


def test_centered_accuracy_is_one_for_a_gold_scorer_and_near_zero_for_a_uniform_one():
    import random

    from pretrainer.eval.tasks import score_task, suite_score

    tok = bpe()
    items = marked_items(3000, random.Random(0))
    mc = [item for item in items if item["type"] == "mc"]

    def gold_scorer(pairs):  # prefers whatever says RIGHT; greedy "matches" only a RIGHT continuation
        return [(10.0 if "RIGHT" in tok.decode(context + continuation) else 0.0, "RIGHT" in tok.decode(continuation))
                for context, continuation in pairs]

    rng = random.Random(1)
    uniform_scorer = lambda pairs: [(rng.random(), False) for _ in pairs]  # noqa: E731
    perfect = [score_task(name, subset, gold_scorer, tok) for name, subset in (("all", items), ("mc", mc))]
    assert all(r["accuracy"] == r["accuracy_norm"] == 1.0 and r["centered"] == 1.0 for r in perfect)
    assert suite_score(perfect) == 1.0
    chance = score_task("mc", mc, uniform_scorer, tok)
    assert chance["chance"] == 0.25 and abs(chance["centered"]) < 0.05 and abs(chance["accuracy"] - 0.25) < 0.04


def test_fewshot_examples_are_other_items_fixed_by_the_seed():
    from pretrainer.eval.tasks import fewshot_prefix, gold_text

    items = [{"type": "lm", "context": f"Q{i}:", "continuation": f" A{i}"} for i in range(10)]
    prefix = fewshot_prefix(items, 3, 4, seed=7)
    assert prefix == fewshot_prefix(items, 3, 4, seed=7) and prefix.count("\n\n") == 4 and "Q3:" not in prefix
    assert "".join(gold_text(items[0])) == "Q0: A0"


def test_choice_loglikelihoods_match_transformers_on_the_exported_model(tmp_path):
    """Our per-choice log-likelihoods (one right-padded batch per item) against a plain computation
    with `transformers` on the same weights, exported and loaded back through hf:DIR."""
    transformers = pytest.importorskip("transformers")
    from pretrainer.config import Config
    from pretrainer.eval.tasks import continuation_scorer
    from pretrainer.hf import export_hf
    from pretrainer.runs import build_model, init_source
    from pretrainer.train.checkpoint import model_weights

    tok = bpe()
    torch.manual_seed(0)
    original = Transformer(ModelConfig(vocab_size=tok.vocab_size, seq_len=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2))
    export_hf(original.cfg, model_weights(original), tok, tmp_path / "hf")
    source_cfg, load = init_source(f"hf:{tmp_path / 'hf'}")
    ours = build_model(Config(model=source_cfg), load)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    context = tok.encode("Question: which is café? Answer:")
    pairs = [(context, tok.encode(choice)) for choice in (" naïve", " crème brûlée", " 日本語")]
    scores = continuation_scorer(ours, torch.device("cpu"), None)(pairs)
    for (ctx, cont), (total, _) in zip(pairs, scores):
        with torch.no_grad():
            logits = theirs(torch.tensor([ctx + cont])).logits[0]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        reference = sum(log_probs[len(ctx) - 1 + j, token].item() for j, token in enumerate(cont))
        assert total == pytest.approx(reference, abs=1e-4)
