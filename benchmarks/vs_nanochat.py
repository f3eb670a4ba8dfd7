"""Quality per token against nanochat (karpathy/nanochat), side by side on the same documents, each with
its own tokenizer, scored by one evaluator in bits per byte over every byte of the same validation text.

    git clone https://github.com/karpathy/nanochat NANOCHAT      # its code is run, never copied here
    pip install -e '.[dev]'                  # what nanochat's scripts import: wandb, jinja2, pyyaml, ...
    python benchmarks/vs_nanochat.py --data data/stdlib-bpe4k --nanochat NANOCHAT --work WORK
        [--sizes 256x4,384x6] [--horizons 150,300] [--cache WORK/nanochat.json]
        [--sides ours,shipped,reference] [--optim.name=adamw ...]   # ours: any config override

The documents: the corpus `--data` was prepared from (its manifest's command: --corpus, --val-fraction,
--seed), read by our corpus reader and split by prepare's own content-hash rule, so the validation
documents are exactly those of `--data`'s val split. nanochat gets them as parquet shards (its format):
the train documents cut at line boundaries into pieces of at most --piece-chars characters (its
BOS-aligned loader crops every document to one row, which would leave it the first 256 tokens of each
file; the cut keeps every byte in training), and the validation documents as its validation shard.

Each side, at matched width, depth (d_model x n_layer, 64-wide heads), sequence length (256) and tokens
per step (16 x 256 = 4,096):
- ours: `pretrainer train` with the defaults (its own bpe:4096 from `--data`) and the overrides given;
- nanochat "shipped": `scripts/base_train.py` as it ships (its own 4,096-token BPE from
  `scripts/tok_train.py` on the same train documents), fp32 on CPU, compiled, full-context attention
  (`--window-pattern L`: a sliding window of 128 at this length is nanochat's GPU-only speed-up);
- nanochat "reference": the same with its learning rates at its reference batch: base_train multiplies
  every learning rate by sqrt(batch / 524,288) (0.088 here), so these runs pass each default divided by
  that factor (its weight decay, also batch-scaled, stays as shipped).

The evaluator (`full_text_bpb`): every validation document's tokens after the side's document-start
token (nanochat's <|bos|>, our end-of-text), in windows of 256 tokens with a stride of 128, each token
scored once with at least 128 tokens of context (less only at a document's start). A window that does
not start a document starts the way that side's training rows do: nanochat's with <|bos|> (its loader
starts every row with one), ours mid-stream (our rows are crops of the token stream). Bits per byte =
the scored tokens' nats / ln 2 / the validation text's UTF-8 bytes. nanochat's own val bpb crops long
documents to their first row and is not comparable.

nanochat's runs are cached (--cache): ablations re-run only our side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_nanogpt import SideFailed, run_side  # noqa: E402 (one way to run a side and report its failure)

MICRO_BATCH, SEQ_LEN, STRIDE = 16, 256, 128
TOKENS_PER_STEP = MICRO_BATCH * SEQ_LEN
B_REF = 2**19  # nanochat's reference batch (tokens): its learning rates are tuned there
NANOCHAT_LRS = {"matrix-lr": 0.02, "embedding-lr": 0.3, "unembedding-lr": 0.008, "scalar-lr": 0.5}


# --- the documents ---


def split_documents(data: Path) -> tuple[list[str], list[str]]:
    """(train, val) documents of the corpus `data` was prepared from, split by prepare's rule; checked
    against its manifest's document counts."""
    from pretrainer.data.prepare import KeyedDocuments, is_val_document
    from pretrainer.data.sources import Corpus, Piece

    manifest = json.loads((data / "manifest.json").read_text())
    words = shlex.split(manifest["command"])
    option = lambda name, default: words[words.index(name) + 1] if name in words else default  # noqa: E731
    corpus = [words[i + 1] for i, w in enumerate(words) if w == "--corpus"]
    seed, fraction = int(option("--seed", manifest["seed"])), float(manifest["val_fraction"])
    splits: dict[str, list[str]] = {"train": [], "val": []}
    parts, key = [], None
    for text, text_key in KeyedDocuments(Corpus(corpus).documents()):
        key = text_key if not parts else key
        parts.append(str(text))
        if isinstance(text, Piece):
            continue
        splits["val" if is_val_document(seed, key, fraction) else "train"].append("".join(parts))
        parts = []
    for name, docs in splits.items():
        expected = manifest["splits"][name]["documents"]
        if len(docs) != expected:
            sys.exit(f"error: {data}: {name} has {expected} documents, the corpus split gives {len(docs)}")
    return splits["train"], splits["val"]


def pieces(document: str, max_chars: int) -> list[str]:
    """A document cut at line boundaries into pieces of at most max_chars (a longer line is its own)."""
    out, current = [], ""
    for line in document.splitlines(keepends=True):
        if current and len(current) + len(line) > max_chars:
            out.append(current)
            current = ""
        current += line
    return out + ([current] if current else [])


def write_nanochat_data(train: list[str], val: list[str], base: Path, piece_chars: int) -> None:
    """nanochat's dataset layout: BASE/base_data_climbmix/shard_NNNNN.parquet, a `text` column in row
    groups; the last shard is its validation split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = base / "base_data_climbmix"
    shards.mkdir(parents=True, exist_ok=True)
    texts = [piece for doc in train for piece in pieces(doc, piece_chars)]
    pq.write_table(pa.table({"text": texts}), shards / "shard_00000.parquet", row_group_size=1024)
    pq.write_table(pa.table({"text": val}), shards / "shard_00001.parquet", row_group_size=1024)


# --- the evaluator ---


@torch.no_grad()
def full_text_bpb(
    logits_of, encode, start_id: int, documents: list[str], *, start_every_window: bool, vocab: int
) -> dict:
    """Bits per byte over every byte of `documents` (module docstring: windows, strides, starts)."""
    windows = []  # (inputs, targets, scored mask), SEQ_LEN each
    for doc in documents:
        ids = [start_id] + encode(doc)
        end = min(SEQ_LEN, len(ids) - 1)  # targets scored so far: ids[1 : end + 1]
        windows.append(window(ids[: end + 1], scored_from=1))
        while end < len(ids) - 1:
            new_end = min(end + STRIDE, len(ids) - 1)
            first = new_end - SEQ_LEN + (1 if start_every_window else 0)  # the window's first input
            piece = ([start_id] if start_every_window else []) + ids[first : new_end + 1]
            windows.append(window(piece, scored_from=len(piece) - (new_end - end)))
            end = new_end
    nats, tokens = 0.0, 0
    for i in range(0, len(windows), MICRO_BATCH):
        batch = windows[i : i + MICRO_BATCH]
        inputs, targets, scored = (torch.tensor([w[j] for w in batch]) for j in range(3))
        logits = logits_of(inputs)[..., :vocab].float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        nats += float((losses * scored).sum())
        tokens += int(scored.sum())
    text_bytes = sum(len(doc.encode("utf-8")) for doc in documents)
    return {"bpb": nats / math.log(2) / text_bytes, "tokens": tokens, "bytes": text_bytes}


def window(ids: list[int], scored_from: int) -> tuple[list[int], list[int], list[int]]:
    """(inputs, targets, scored) padded to SEQ_LEN: targets ids[1:], scored from target scored_from - 1."""
    inputs, targets = ids[:-1], ids[1:]
    scored = [0] * (scored_from - 1) + [1] * (len(targets) - scored_from + 1)
    pad = SEQ_LEN - len(inputs)
    return inputs + [0] * pad, targets + [0] * pad, scored + [0] * pad


# --- the sides ---


def train_ours(
    data: Path, val: list[str], d_model: int, n_layer: int, horizon: int, overrides: list[str], run_dir: Path
) -> dict:
    """`pretrainer train` at this shape and horizon, then its checkpoint scored on the val documents."""
    run_args = [
        f"--data.dir={data}",
        f"--run.dir={run_dir}",
        f"--model.d_model={d_model}",
        f"--model.n_layer={n_layer}",
        f"--model.n_head={d_model // 64}",
        f"--model.seq_len={SEQ_LEN}",
        f"--train.micro_batch={MICRO_BATCH}",
        "--train.grad_accum=1",
        f"--train.max_steps={horizon}",
        "--eval.every=0",
        "--eval.tasks_every=0",
        "--ckpt.every=0",
        "--log.every=50",
        "--track.backends=none",
        "--train.device=cpu",
        *overrides,
    ]
    run_side("pretrainer", [sys.executable, "-m", "pretrainer", "train", *run_args])
    from pretrainer.artifacts.runs import build_model, open_run
    from pretrainer.data.data_dir import open_data_dir

    opened, tokenizer = open_run(run_dir), open_data_dir(data).tokenizer
    model = build_model(opened.cfg, opened.load_weights).eval()
    return full_text_bpb(
        lambda x: model(x)[0],
        tokenizer.encode,
        tokenizer.eot_id,
        val,
        start_every_window=False,
        vocab=tokenizer.vocab_size,
    )


def train_nanochat(checkout: Path, base: Path, d_model: int, n_layer: int, horizon: int, lrs: str) -> dict:
    """base_train.py in `checkout` (its data and tokenizer under `base`), then its checkpoint scored."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    scale = math.sqrt(TOKENS_PER_STEP / B_REF)
    tag = f"d{n_layer}-w{d_model}-h{horizon}-{lrs}"
    command = [
        sys.executable,
        "-m",
        "scripts.base_train",
        "--device-type=cpu",
        f"--depth={n_layer}",
        f"--aspect-ratio={d_model // n_layer}",
        "--head-dim=64",
        f"--max-seq-len={SEQ_LEN}",
        "--window-pattern=L",
        f"--num-iterations={horizon}",
        f"--device-batch-size={MICRO_BATCH}",
        f"--total-batch-size={TOKENS_PER_STEP}",
        "--eval-every=-1",
        "--core-metric-every=-1",
        "--sample-every=-1",
        f"--model-tag={tag}",
        *([f"--{name}={lr / scale}" for name, lr in NANOCHAT_LRS.items()] if lrs == "reference" else []),
    ]
    run_side(f"nanochat ({lrs})", command, cwd=checkout, env=env)
    return score_nanochat(checkout, base, tag, horizon)


def score_nanochat(checkout: Path, base: Path, tag: str, step: int) -> dict:
    """nanochat's checkpoint (loaded with weights_only) in nanochat's own GPT class, scored by
    full_text_bpb on the validation documents with its tokenizer."""
    sys.path.insert(0, str(checkout))
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import RustBPETokenizer

    directory = base / "base_checkpoints" / tag
    meta = json.loads((directory / f"meta_{step:06d}.json").read_text())
    with torch.device("meta"):
        model = GPT(GPTConfig(**meta["model_config"]))
    model.to_empty(device="cpu")
    model.init_weights()  # the rotary tables (buffers, not saved); the weights come from the file
    weights = torch.load(directory / f"model_{step:06d}.pt", map_location="cpu", weights_only=True)
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in weights.items()}, strict=True)
    model.eval()
    tokenizer = RustBPETokenizer.from_directory(str(base / "tokenizer"))
    import pyarrow.parquet as pq

    val = pq.read_table(base / "base_data_climbmix" / "shard_00001.parquet").column("text").to_pylist()
    return full_text_bpb(
        model,
        tokenizer.encode,
        tokenizer.get_bos_token_id(),
        val,
        start_every_window=True,
        vocab=tokenizer.get_vocab_size(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, type=Path, help="a data dir prepared with bpe:N")
    parser.add_argument("--nanochat", required=True, type=Path, help="a karpathy/nanochat checkout")
    parser.add_argument("--work", required=True, type=Path, help="runs, nanochat's data and tokenizer")
    parser.add_argument("--sizes", default="256x4,384x6", help="d_model x n_layer, comma-separated")
    parser.add_argument("--horizons", default="150,300", help="optimizer steps, comma-separated")
    parser.add_argument("--sides", default="ours,shipped,reference", help="which sides to run")
    parser.add_argument("--piece-chars", type=int, default=1000, help="nanochat's train pieces (chars)")
    parser.add_argument("--cache", type=Path, help="nanochat's scores, read and extended (JSON)")
    args, overrides = parser.parse_known_args()
    data, work, sides = args.data.resolve(), args.work.resolve(), args.sides.split(",")
    checkout = args.nanochat.resolve()
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    base = work / "nanochat"
    train, val = split_documents(data)
    print(f"documents: {len(train):,} train, {len(val):,} val ({sum(len(d.encode()) for d in val):,} bytes)")
    print(f"pretrainer overrides: {' '.join(overrides) or '(none: the defaults)'}", flush=True)
    if any(side != "ours" for side in sides) and not (base / "tokenizer").exists():
        write_nanochat_data(train, val, base, args.piece_chars)
        env = {**os.environ, "NANOCHAT_BASE_DIR": str(base)}
        run_side("nanochat tokenizer", [sys.executable, "-m", "scripts.tok_train", f"--vocab-size={vocab}"],
            cwd=checkout, env=env)  # fmt: skip
    rows = []
    for size in args.sizes.split(","):
        d_model, n_layer = (int(x) for x in size.split("x"))
        for horizon in (int(h) for h in args.horizons.split(",")):
            row = {"size": size, "steps": horizon, "tokens": horizon * TOKENS_PER_STEP}
            for lrs in ("shipped", "reference"):
                key = f"{data} {size} {horizon} {lrs} {args.piece_chars}"
                if lrs in sides and key not in cache:
                    cache[key] = train_nanochat(checkout, base, d_model, n_layer, horizon, lrs)
                    if args.cache:
                        args.cache.write_text(json.dumps(cache, indent=1) + "\n")
                row[lrs] = cache.get(key, {}).get("bpb")
            if "ours" in sides:
                run_dir = work / "ours" / f"{size}-{horizon}"
                row["ours"] = train_ours(data, val, d_model, n_layer, horizon, overrides, run_dir)["bpb"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| size | steps | tokens | pretrainer | nanochat shipped | nanochat, LRs at its reference batch "
          "| ours - reference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    cell = lambda value: "-" if value is None else f"{value:.3f}"  # noqa: E731
    for r in rows:
        ours, reference = r.get("ours"), r["reference"]
        gap = "-" if ours is None or reference is None else f"{ours - reference:+.3f}"
        print(f"| {r['size']} | {r['steps']} | {r['tokens']:,} | {cell(ours)} | {cell(r['shipped'])} "
              f"| {cell(reference)} | {gap} |")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except SideFailed as e:  # what the failing side printed, not only that it failed
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
