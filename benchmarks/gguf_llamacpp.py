"""Does llama.cpp generate what `pretrainer sample` does, from `pretrainer export --format gguf`?

    python -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python   # builds llama.cpp (~7 min)
    python benchmarks/gguf_llamacpp.py --data data/stdlib-bpe4k --runs runs/gguf \
        --llama-python /tmp/llama/bin/python

Runs RUNS/llama, RUNS/qwen3 and RUNS/gpt2 (configs/tiny-cpu.toml, the quickstart's: without QK-norm, as
it is, and with arch gpt2; trained here first where missing) are exported as f16 and q8_0 with the CLI.
For each prompt both get the same prompt ids and decode greedily: ours with model/generate.py at
temperature 0 on the CPU in float32 (what `pretrainer sample --temperature 0 --device cpu` runs),
llama.cpp with llama-cpp-python's Llama.generate at temp 0 (its greedy sampler). Reported per prompt:
how many of the 32 tokens agree before the first difference; the largest gap between llama.cpp's logits
and ours along our continuation (both fed the same ids: teacher-forced); and at a first difference, how
far apart the two candidates were in our logits (a near tie that rounding flips, or a real
disagreement).

Then the tokenizers: llama.cpp's tokenize(text) against ours on standard-library files, for each kind
the export writes a different tokenizer.ggml.pre for: our bpe:N (llama-bpe), GPT-2's (gpt-2) and an hf:
byte-level BPE with ByteLevel's own split (gpt-2). That checks the pre-tokenizer the export names.

llama.cpp runs in its own interpreter (llama-cpp-python need not be in the pretrainer venv): this file,
run there with --worker REQUEST.json, imports only llama_cpp and numpy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "",  # `pretrainer sample` with no prompt starts after an end-of-text
    "def main(",
    "import os\nimport sys\n\n\ndef ",
    "class Parser:\n    def __init__(self, ",
    "    for i in range(len(",
    'if __name__ == "__main__":\n    ',
    "# Licensed to the PSF under a contributor agreement.\n",
    "    return self._",
]
EXTRA_TEXTS = [  # what the standard library has little of
    "naïve café — 日本語 🙂 Ünïcödé",
    "   spaces   \n\n\n  x\t\ttabs\r\nCRLF  ",
    "1234567 + 89.01e-5 == 0x1F",
    "I'm sure you'll see they've 'RE' done, DON'T",
]


# --- the llama.cpp side (run by --llama-python with --worker) ---


def worker(request_path: str) -> None:
    """Each model of the request: greedy continuations of the prompts, llama.cpp's logits along ours,
    its tokenization of the texts -> REQUEST.answer.json (+ one .npy of logits per prompt)."""
    import numpy as np
    from llama_cpp import Llama

    request = json.loads(Path(request_path).read_text())
    answers = []
    for job in request["models"]:
        llm = Llama(job["gguf"], n_ctx=job["n_ctx"], n_threads=2, logits_all=True, seed=0, verbose=False)
        answer = {"gguf": job["gguf"], "prompts": [], "tokenized": []}
        for k, prompt in enumerate(job["prompts"]):
            ids, ours = prompt["ids"], prompt["ours"]
            llm.reset()
            greedy = []
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                greedy.append(int(token))
                if len(greedy) == len(ours):
                    break
            llm.reset()
            llm.eval(ids + ours[:-1])  # teacher-forced: the logits that chose each of our tokens
            logits = Path(request_path).with_suffix(f".{len(answers)}.{k}.npy")
            np.save(logits, np.array(llm.scores[len(ids) - 1 : len(ids) + len(ours) - 1], dtype=np.float32))
            text_ids = llm.tokenize(prompt["text"].encode(), add_bos=False, special=False)
            answer["prompts"].append({"greedy": greedy, "logits": str(logits), "text_ids": text_ids})
        for text in job["texts"]:
            answer["tokenized"].append(llm.tokenize(text.encode(), add_bos=False, special=False))
        answers.append(answer)
        del llm
    Path(request_path).with_suffix(".answer.json").write_text(json.dumps(answers))


def ask_llama_cpp(llama_python: str, models: list[dict], work: Path) -> list[dict]:
    request = work / "request.json"
    request.write_text(json.dumps({"models": models}))
    subprocess.run([llama_python, __file__, "--worker", str(request)], check=True)
    return json.loads(request.with_suffix(".answer.json").read_text())


# --- our side ---


def cli(*args: str) -> None:
    command = [sys.executable, "-m", "pretrainer", *map(str, args)]
    print("$ pretrainer", " ".join(map(str, args)), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def trained(run: Path, family: str, data: Path) -> Path:
    if not (run / "checkpoints").is_dir():
        shape = {  # qwen3: the default llama (model.qk_norm = auto: on) exports as llama.cpp's qwen3
            "gpt2": ["--model.arch=gpt2", "--model.n_kv_head=0"],
            "llama": ["--model.qk_norm=false"],
            "qwen3": [],
        }[family]
        settings = [f"--data.dir={data}", f"--run.dir={run}", "--track.backends=none", *shape]
        cli("train", "configs/tiny-cpu.toml", *settings)
    return run


def our_continuations(run: Path, new_tokens: int) -> tuple[list[dict], int, object]:
    """Each prompt's ids, our greedy continuation and our logits along it (teacher-forced) -> (prompts,
    the model's context, the tokenizer)."""
    import torch

    from pretrainer.artifacts.runs import build_model, open_run
    from pretrainer.cli.verbs_model import generation_precision
    from pretrainer.model.generate import generate

    opened = open_run(run)
    model = build_model(opened.cfg, opened.load_weights, str(opened.checkpoint)).eval()
    tokenizer = opened.tokenizer()
    vocab = tokenizer.vocab_size
    prompts = []
    for text in PROMPTS:
        # as cmd_sample: the tokenizer's BOS first where documents have one, an end-of-text for no prompt
        prefix = [tokenizer.bos_id] if tokenizer.bos_id is not None else [] if text else [tokenizer.eot_id]
        ids = prefix + tokenizer.encode(text)
        with torch.no_grad(), generation_precision(opened, torch.device("cpu")):
            out = generate(model, torch.tensor([ids]), new_tokens, temperature=0.0, vocab_in_use=vocab)
            ours = out[0, len(ids) :].tolist()
            logits, _ = model(out[:, :-1])
        along = logits[0, len(ids) - 1 :, :vocab].float().numpy()
        prompts.append(
            {"text": text, "text_ids": tokenizer.encode(text), "ids": ids, "ours": ours, "our_logits": along}
        )
    return prompts, opened.cfg.model.seq_len, tokenizer


def compare(prompt: dict, answer: dict) -> dict:
    import numpy as np

    ours, theirs = prompt["ours"], answer["greedy"]
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    their_logits, our_logits = np.load(answer["logits"]), prompt["our_logits"]
    row = {
        "prompt": prompt["text"],
        "agree": agree,
        "of": len(ours),
        "max_logit_gap": float(np.abs(their_logits - our_logits).max()),
        "logit_range": float(our_logits.max() - our_logits.min()),
        "prompt_tokenized_alike": answer["text_ids"] == prompt["text_ids"],  # llama.cpp's tokenize(text)
    }
    if agree < len(ours):  # how close our own two candidates were where the paths part
        step = our_logits[agree]
        row["ours_vs_theirs_in_our_logits"] = float(step[ours[agree]] - step[theirs[agree]])
    return row


def stdlib_texts(count: int) -> list[str]:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    files = files[:: max(1, len(files) // count)][:count]  # spread over the tree: tests hold most non-ASCII
    return [f.read_text(encoding="utf-8", errors="replace") for f in files] + EXTRA_TEXTS


def tokenizer_cases(run_tokenizer, work: Path, texts: list[str]) -> list[tuple[str, object, Path]]:
    """(label, tokenizer, a GGUF of a 1-layer random model with it) for each pre-tokenizer the export
    writes: the runs' bpe:N, GPT-2's, an hf: byte-level BPE splitting with ByteLevel's own regex."""
    import torch
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from pretrainer.artifacts.checkpoint import model_weights
    from pretrainer.artifacts.gguf_format import export_gguf
    from pretrainer.config.schema import ModelConfig
    from pretrainer.data.tokenizers.bpe import load_gpt2
    from pretrainer.data.tokenizers.hf import load_hf_tokenizer
    from pretrainer.model import Transformer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts[: len(texts) // 2], trainer)  # half: the other half is unseen text
    (work / "hf-bytelevel").mkdir()
    backend.save(str(work / "hf-bytelevel" / "tokenizer.json"))
    cases = []
    for label, tokenizer in [
        (f"{run_tokenizer.name} (ours, GPT-4 split)", run_tokenizer),
        ("gpt2 (tiktoken)", load_gpt2()),
        ("hf: byte-level BPE, 2048 (ByteLevel's split)", load_hf_tokenizer(f"hf:{work / 'hf-bytelevel'}")),
    ]:
        cfg = ModelConfig(
            arch="llama", vocab_size=tokenizer.vocab_size, seq_len=64, d_model=32, n_layer=1, n_head=2
        )
        torch.manual_seed(0)
        path = work / f"tokenizer-{len(cases)}.gguf"
        export_gguf(cfg, model_weights(Transformer(cfg)), tokenizer, path, dtype="f16")
        cases.append((label, tokenizer, path))
    return cases


def main() -> None:
    from gguf import GGUFReader

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT / "data/stdlib-bpe4k")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs/gguf")
    parser.add_argument("--llama-python", required=True, help="a python with llama-cpp-python installed")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="f16,q8_0", help="the GGUF dtypes to export and compare")
    parser.add_argument("--texts", type=int, default=300, help="standard-library files to tokenize")
    parser.add_argument("--out", type=Path, help="write every row as JSON here too")
    args = parser.parse_args()

    rows, jobs, expected = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for family in ("llama", "qwen3", "gpt2"):
            run = trained(args.runs.resolve() / family, family, args.data.resolve())
            prompts, n_ctx, tokenizer = our_continuations(run, args.new_tokens)
            for dtype in args.dtypes.split(","):
                gguf_path = run / f"model-{dtype}.gguf"
                cli("export", run, "--format", "gguf", "--dtype", dtype, "--out", gguf_path, "--force")
                payload = [{k: p[k] for k in ("text", "ids", "ours")} for p in prompts]
                jobs.append({"gguf": str(gguf_path), "n_ctx": n_ctx, "prompts": payload, "texts": []})
                expected.append((family, dtype, prompts))
        texts = stdlib_texts(args.texts)
        cases = tokenizer_cases(tokenizer, work, texts)
        for _, _, path in cases:
            jobs.append({"gguf": str(path), "n_ctx": 64, "prompts": [], "texts": texts})
        answers = ask_llama_cpp(args.llama_python, jobs, work)

        print("\n| family | dtype | prompt | tokens equal | max logit gap (ours' range) | first difference |")
        print("|---|---|---|---:|---:|---|")
        for (family, dtype, prompts), answer in zip(expected, answers):
            for prompt, their in zip(prompts, answer["prompts"]):
                row = {"family": family, "dtype": dtype, **compare(prompt, their)}
                rows.append(row)
                where = (
                    f"ours {row['ours_vs_theirs_in_our_logits']:.3f} logits above llama.cpp's pick"
                    if "ours_vs_theirs_in_our_logits" in row
                    else ""
                )
                prompt_text = json.dumps(row["prompt"])[1:-1] + (
                    "" if row["prompt_tokenized_alike"] else " (!)"
                )
                agreement = f"{row['agree']}/{row['of']}"
                gap = f"{row['max_logit_gap']:.4f} ({row['logit_range']:.1f})"
                print(f"| {family} | {dtype} | `{prompt_text}` | {agreement} | {gap} | {where} |")
        print("\n| tokenizer | pre | texts tokenized identically | tokens |")
        print("|---|---|---:|---:|")
        for (label, tokenizer, path), answer in zip(cases, answers[len(expected) :]):
            ours = [tokenizer.encode(text) for text in texts]
            same = sum(a == b for a, b in zip(ours, answer["tokenized"]))
            pre = GGUFReader(path).fields["tokenizer.ggml.pre"].contents()
            print(f"| {label} | {pre} | {same}/{len(texts)} | {sum(map(len, ours)):,} |")
            rows.append({"tokenizer": label, "pre": pre, "texts_equal": same, "texts": len(texts)})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
