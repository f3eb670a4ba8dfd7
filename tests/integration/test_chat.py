"""the chat format, masked loss, document packing, mixtures, stage chaining and chat."""

from __future__ import annotations

import io
import json

from chat_tasks import split_reversal
from helpers import tiny_config
from support.chat_helpers import SMALL

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.config.load import load_config
from pretrainer.data.data_dir import open_data_dir
from pretrainer.model import Transformer
from pretrainer.train.loop import train

# --- pretrain -> SFT -> chat ---


def held_out_accuracy(model, tokenizer) -> float:
    from pretrainer.cli.chat import ChatSession

    session = ChatSession(model.eval(), tokenizer, temperature=0.0, top_k=0, max_new_tokens=12, seed=0)
    _, held_out = split_reversal()
    right = 0
    for question, answer in held_out:
        session.reset()
        right += "".join(session.reply(question)).strip() == answer
    return right / len(held_out)


def test_sft_on_conversations_teaches_a_held_out_skill_and_chat_answers(
    text_data, chat_data, tmp_path, run_cli, monkeypatch, capsys
):
    from safetensors.torch import load_file

    from pretrainer.artifacts.checkpoint import latest_checkpoint
    from pretrainer.artifacts.runs import grow_vocabulary, open_run

    base, sft = tmp_path / "base", tmp_path / "sft"
    quiet = {"eval.every": 0, "ckpt.every": 0, "log.every": 100, **SMALL}
    train(tiny_config(text_data, base, **quiet, **{"train.max_steps": 60, "train.micro_batch": 16}))
    chat_tokenizer = open_data_dir(chat_data).tokenizer
    # the base model, its vocabulary grown by the chat tokens, as SFT starts it: no skill yet
    base_run = open_run(base)
    # the base's rows (its tokenizer's 300 padded to 384) hold the 7 chat tokens already
    vocab = max(base_run.cfg.model.vocab_size, chat_tokenizer.vocab_size)
    start_cfg = load_config(
        None, [f"--model.{k.split('.')[1]}={v}" for k, v in SMALL.items()] + [f"--model.vocab_size={vocab}"]
    ).model
    start = Transformer(start_cfg)
    start.load_state_dict(grow_vocabulary(base_run.load_weights(), vocab), strict=False)
    assert held_out_accuracy(start, chat_tokenizer) <= 0.05

    train(
        tiny_config(
            chat_data,
            sft,
            **quiet,
            **{
                "init.from": base,
                # Muon, the default optimizer: held-out accuracy 0.89 after 120 steps, 1.0 after 160 (one
                # thread). AdamW at this lr was on a knife's edge (0.27 after 250 steps and 0.98 after 320
                # on one machine, 0.07 after 360 on another)
                "train.max_steps": 180,
                "train.micro_batch": 32,
                "optim.name": "muon",
                "optim.lr": 4e-3,
                "optim.warmup_steps": 20,
            },
        )
    )
    assert f"pretrainer chat {sft}" in capsys.readouterr().out  # next: names chat after SFT
    run = open_run(sft)
    # the chat tokens (300 -> 307) fit in the base's padding rows (300 -> 384): no row is added
    assert run.cfg.model.vocab_size == base_run.cfg.model.vocab_size == 384 > chat_tokenizer.vocab_size
    # scored the documented way: one held-out prompt per line piped into `chat`, line N answering line N
    _, held_out = split_reversal()
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{question}\n" for question, _ in held_out)))
    code, out, err = run_cli("chat", sft, "--temperature", "0", "--max-new-tokens", "12")
    replies = out.splitlines()
    assert code == 0 and len(replies) == len(held_out), err[-2000:]
    accuracy = sum(reply.strip() == answer for reply, (_, answer) in zip(replies, held_out)) / len(held_out)
    assert accuracy >= 0.8, accuracy
    # the chain is traceable from the final run: the parent checkpoint and the hash of its weights
    parent = run.state["parent"]
    base_checkpoint = latest_checkpoint(base)
    assert parent["checkpoint"] == str(base_checkpoint) and parent["step"] == 60
    assert (
        parent["model_sha256"]
        == json.loads((base_checkpoint / "COMPLETE").read_text())["files"]["model.safetensors"]["sha256"]
    )
    assert 0 < run.state["trained_tokens"] < run.state["tokens"]
    # the padded rows stay; the chat tokens' ids are among them
    assert load_file(run.checkpoint / "model.safetensors")["wte.weight"].shape[0] == 384

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+3?\n"))  # piped, not a terminal
    code, out, err = run_cli("chat", sft, "--max-new-tokens", "20")
    assert code == 0, err[-2000:]
    assert len(out.strip().splitlines()) == 1 and out.strip()


def test_a_mixture_of_text_and_chat_resumes_the_identical_stream_and_logs_shares(
    text_data, chat_data, tmp_path
):
    mixture = f"{text_data}:0.7,{chat_data}:0.3"
    steps = {
        "data.dir": "",
        "data.mixture": mixture,
        "train.max_steps": 12,
        "log.every": 1,
        "eval.every": 0,
        "ckpt.every": 0,
        "log.sequences": True,
        **SMALL,
    }
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(tiny_config(text_data, straight, **steps))
    train(tiny_config(text_data, stopped, **steps, **{"train.stop_at_step": 5}))
    train(tiny_config(text_data, stopped, **steps))  # resumes at step 5
    a, b = (read_metrics(run / "metrics.jsonl") for run in (straight, stopped))
    losses = lambda records: {r["step"]: r["loss"] for r in records if "loss" in r}  # noqa: E731
    assert losses(a) == losses(b) and len(losses(a)) == 12
    reads = lambda run: [
        json.loads(line)["ids"] for line in (run / "sequences-rank0.jsonl").read_text().splitlines()
    ]  # noqa: E731
    assert reads(straight) == reads(stopped)
    last = [r for r in a if "loss" in r][-1]
    # 96 sequences; the 1,000-sequence bound is above
    assert abs(last[f"mix_share/{text_data.parent.name}/{text_data.name}"] - 0.7) < 0.05
    assert last["trained_tokens"] < last["tokens"]
