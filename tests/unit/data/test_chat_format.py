"""the chat format, masked loss, document packing, mixtures, stage chaining and chat."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from chat_tasks import conversation, write_jsonl
from support.chat_helpers import prepare_chat

from pretrainer.config.load import load_config
from pretrainer.config.schema import ModelConfig
from pretrainer.core.errors import UserError
from pretrainer.data.data_dir import open_data_dir
from pretrainer.data.loader import SequenceLoader, TokenSource, validation_batches
from pretrainer.data.tokenizers.chat_format import (
    ASSISTANT_END,
    ASSISTANT_START,
    BOS,
    CHAT_TOKENS,
    USER_START,
    render,
)
from pretrainer.model import Transformer
from pretrainer.model.loss import IGNORE_INDEX

# --- the format ---


def test_template_mask_and_special_tokens(chat_data, text_data):
    data, base = open_data_dir(chat_data), open_data_dir(text_data)
    tok = data.tokenizer
    assert data.is_chat and tok.extends(base.tokenizer) and not base.tokenizer.extends(tok)
    assert [tok.special_tokens[name] for name in CHAT_TOKENS] == list(
        range(base.vocab_size, base.vocab_size + len(CHAT_TOKENS))
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi <|user_start|>"},
        {"role": "assistant", "content": "hello"},
    ]
    ids, mask = render(messages, tok)
    hello = tok.encode("hello")
    start = ids.index(tok.special_tokens[ASSISTANT_START]) + 1
    assert ids[0] == tok.special_tokens[BOS] and ids[-1] == tok.eot_id
    assert ids[start : start + len(hello) + 1] == hello + [tok.special_tokens[ASSISTANT_END]]
    # the answer and its end only
    assert [i for i, m in enumerate(mask) if m] == list(range(start, start + len(hello) + 1))
    assert ids.count(tok.special_tokens[USER_START]) == 1  # typed special-token text stays text
    info = data.manifest["splits"]["train"]
    masks = np.asarray(data.mask("train"))
    assert len(masks) == info["tokens"] and int(masks.sum()) == info["trained_tokens"] > 0
    assert "template" in data.manifest["chat"] and data.manifest["tokenizer"]["from"] == str(text_data)


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], "unknown role 'tool'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}], "empty content"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "where 'assistant' was expected",
        ),
        ([{"role": "user", "content": "a"}], "does not end with an assistant"),
        ([{"role": "assistant", "content": "a"}], "where 'user' was expected"),
    ],
)
def test_malformed_conversations_name_file_and_line_or_are_skipped(tmp_path, messages, problem, text_data):
    good = conversation("hi", "hello")
    path = write_jsonl(tmp_path / "c.jsonl", [good, {"messages": messages}, good])
    with pytest.raises(UserError, match=rf"c.jsonl:2: malformed conversation: .*{problem}"):
        prepare_chat(path, tmp_path / "out", val_fraction=0.3, tokenizer_from=text_data)
    assert not (tmp_path / "out").exists()  # nothing half-written
    path = write_jsonl(
        tmp_path / "c.jsonl", [conversation(f"hi {i}", "hello") for i in range(20)] + [{"messages": messages}]
    )
    manifest = json.loads(
        (
            prepare_chat(path, tmp_path / "out", on_bad="skip", val_fraction=0.3, tokenizer_from=text_data)
            / "manifest.json"
        ).read_text()
    )
    assert (
        manifest["chat"]["bad_conversations"] == 1
        and sum(s["documents"] for s in manifest["splits"].values()) == 20
    )


def test_parquet_messages_column(tmp_path, text_data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [conversation(f"q{i}", f"a{i}")["messages"] for i in range(30)]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "c.parquet")
    out = prepare_chat(tmp_path / "c.parquet", tmp_path / "out", val_fraction=0.2, tokenizer_from=text_data)
    data = open_data_dir(out)
    assert data.manifest["splits"]["train"]["documents"] + data.manifest["splits"]["val"]["documents"] == 30


# --- masked loss ---


def tiny_model(arch: str = "llama", vocab: int = 97, seq_len: int = 64) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        ModelConfig(
            arch=arch,
            vocab_size=vocab,
            seq_len=seq_len,
            d_model=32,
            n_layer=2,
            n_head=4,
            n_kv_head=2 if arch == "llama" else 0,
        )
    )


def test_masked_targets_send_exactly_zero_gradient():
    model = tiny_model()
    x = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    y[:, :7] = IGNORE_INDEX  # e.g. the user's turn
    captured = {}

    def keep_grad(module, inputs, out):
        out.register_hook(lambda g: captured.update(grad=g))

    model.norm.register_forward_hook(keep_grad)
    model(x, y)[1].backward()
    assert (captured["grad"][:, :7] == 0).all() and (captured["grad"][:, 7:] != 0).all()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the reference: plain cross-entropy over the assistant positions only
    logits, _ = model(x)
    torch.nn.functional.cross_entropy(logits[:, 7:].reshape(-1, 97), y[:, 7:].reshape(-1)).backward()
    for name, param in model.named_parameters():
        assert torch.allclose(fused[name], param.grad, atol=1e-6, rtol=1e-4), name


# --- packing ---


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_document_packing_equals_each_document_alone(arch):
    model = tiny_model(arch).eval()
    eot = 96
    g = torch.Generator().manual_seed(1)
    docs = [torch.cat([torch.randint(0, 96, (n,), generator=g), torch.tensor([eot])]) for n in (9, 20, 14)]
    packed = torch.cat(docs)[None]
    x, y = packed[:, :-1], packed[:, 1:].clone()
    y[x == eot] = IGNORE_INDEX  # a new document's first token is not predicted from the previous one
    losses, _ = model(x, y, per_token=True, doc_separator=eot)
    alone = []
    for doc in docs:
        doc_losses, _ = model(doc[None, :-1], doc[None, 1:], per_token=True)
        alone.append(doc_losses[0])
    # each separator's target: ignored
    expected = torch.cat([torch.cat([a, torch.zeros(1)]) for a in alone])[: x.size(1)]
    assert (losses[0] - expected).abs().max().item() < 1e-5
    # without document masking the later documents see the earlier ones
    plain, _ = model(x, y, per_token=True)
    assert (plain[0] - expected).abs().max().item() > 1e-3


def test_pad_packing_one_document_per_row_and_reports_padding():
    eot = 9
    tokens = np.array([1, 2, 3, eot, 4, 5, eot, 6, 7, 8, 1, 2, 3, 4, eot], dtype=np.uint16)
    source = TokenSource(tokens, seq_len=6, packing="pad", eot_id=eot)
    assert source.n_sequences == 3 and source.truncated == 1
    [(x, y)] = validation_batches(source, 6, 3, 1)
    assert x[0].tolist() == [1, 2, 3, eot, eot, eot] and y[0].tolist() == [2, 3, eot, -1, -1, -1]
    assert y[2].tolist() == [7, 8, 1, 2, 3, 4]  # cut at seq_len + 1 tokens
    assert source.pad_fraction == pytest.approx(1 - (3 + 2 + 6) / 18)


# --- mixtures ---


def test_mixture_shares_within_two_percent_and_resume_continues_the_stream():
    a, b = (
        TokenSource(np.arange(n * 8 + 1, dtype=np.uint16) % 1000, 8, name=name)
        for n, name in ((300, "a"), (500, "b"))
    )
    loader = SequenceLoader([a, b], 8, micro_batch=4, grad_accum=5, seed=3, weights=[0.7, 0.3])
    for _ in range(50):  # 1,000 sequences
        loader.next_step()
    shares = loader.shares()
    assert abs(shares["a"] - 0.7) < 0.02 and abs(shares["b"] - 0.3) < 0.02
    for start in range(0, 5000, 1000):  # every window of 1,000, not only the first
        window = loader.mixture.counts(start + 1000) - loader.mixture.counts(start)
        assert abs(window[0] / 1000 - 0.7) < 0.02
    straight = SequenceLoader([a, b], 8, micro_batch=4, grad_accum=5, seed=3, weights=[0.7, 0.3])
    stopped = SequenceLoader([a, b], 8, micro_batch=4, grad_accum=5, seed=3, weights=[0.7, 0.3])
    for _ in range(7):
        straight.next_step(), stopped.next_step()
    resumed = SequenceLoader([a, b], 8, micro_batch=4, grad_accum=5, seed=3, weights=[0.7, 0.3])
    resumed.load_state_dict(stopped.state_dict())
    for _ in range(40):  # past the end of source a's first epoch
        assert [t.tolist() for xy in straight.next_step() for t in xy] == [
            t.tolist() for xy in resumed.next_step() for t in xy
        ]
    with pytest.raises(UserError, match="same data dir"):
        SequenceLoader([a, b], 8, 4, 5, seed=3, weights=[0.5, 0.5]).load_state_dict(stopped.state_dict())


def test_mixture_config_from_toml_and_command_line(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[data]\nmixture = [{dir = "a", weight = 0.7}, {dir = "b", weight = 0.3}]\n'
    )
    assert load_config(tmp_path / "c.toml").data.mixture == [
        {"dir": "a", "weight": 0.7},
        {"dir": "b", "weight": 0.3},
    ]
    assert load_config(None, ["--data.mixture=x:1,y:3"]).data.mixture == [
        {"dir": "x", "weight": 1.0},
        {"dir": "y", "weight": 3.0},
    ]
    with pytest.raises(UserError, match="DIR:WEIGHT"):
        load_config(None, ["--data.mixture=x:0,y:1"])
    with pytest.raises(UserError, match="not both"):
        load_config(None, ["--data.mixture=x:1,y:1", "--data.dir=z"])
