import json
import tomllib
from pathlib import Path

import pytest
import torch

from pretrainer.cli.main import main
from pretrainer.config.doc import config_text_with_help, keys_reference
from pretrainer.config.keys import all_keys, config_hash, key_help, save_config
from pretrainer.config.load import load_config, parse_overrides
from pretrainer.core.device import compiles
from pretrainer.core.errors import UserError


def test_toml_and_dotted_overrides(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\narch = "gpt2"\nd_model = 96\n[optim]\nlr = 1\n')
    cfg = load_config(path, ["--optim.lr=3e-4", "--train.max_steps", "1e3", "--train.compile=true"])
    assert cfg.model.arch == "gpt2" and cfg.model.d_model == 96
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.compile == "true"


def test_unknown_key_in_file_names_key_and_suggests(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlrr = 0.1\n")
    with pytest.raises(
        UserError,
        match=r"c\.toml: unknown config key 'optim\.lrr'; did you mean 'optim\.lr' \(peak learning rate\)\?",
    ):
        load_config(path)


def test_unknown_override_suggests_closest():
    with pytest.raises(
        UserError, match=r"unknown config key 'train\.max_step'; did you mean 'train\.max_steps'"
    ):
        load_config(None, ["--train.max_step=5"])


def test_wrong_type_is_an_error():
    with pytest.raises(UserError, match=r"'train\.micro_batch' must be int, got '2\.5'"):
        load_config(None, ["--train.micro_batch=2.5"])
    with pytest.raises(UserError, match="must be bool"):
        load_config(None, ["--mlflow.enabled=maybe"])
    with pytest.raises(UserError, match="compile = 'maybe' is not allowed: it must be one of auto, true"):
        load_config(None, ["--train.compile=maybe"])


def test_compile_is_on_for_cuda_and_off_on_cpu_unless_set(tmp_path):
    """train.compile = auto (the default): the first GPU run is compiled, a CPU run is not; TOML's
    booleans and the CLI's words still set it either way."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert load_config(None, []).train.compile == "auto"
    assert compiles("auto", cuda) and not compiles("auto", cpu)
    assert compiles("true", cpu) and not compiles("false", cuda)
    path = tmp_path / "c.toml"
    path.write_text("[train]\ncompile = false\n")
    assert load_config(path, []).train.compile == "false"
    assert load_config(path, ["--train.compile=on"]).train.compile == "true"


def test_invalid_values_are_errors():
    with pytest.raises(
        UserError, match=r"^command line: ckpt.keep = 1 is not allowed: it must be an integer >= 2$"
    ):
        load_config(None, ["--ckpt.keep=1"])
    with pytest.raises(UserError, match="divisible by model.n_kv_head"):
        load_config(None, ["--model.n_head=4", "--model.n_kv_head=3"])


def test_resolved_config_round_trips_through_toml(tmp_path: Path):
    cfg = load_config(None, ["--optim.lr=1e-3", "--model.arch=gpt2", "--data.dir=some/dir"])
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg and config_hash(again) == config_hash(cfg)


def test_hash_ignores_only_stop_resume_and_run_dir_keys():
    base = load_config(None, [])
    assert config_hash(base) == config_hash(
        load_config(None, ["--train.stop_at_step=20", "--train.resume=never", "--run.dir=moved/elsewhere"])
    )
    assert config_hash(base) != config_hash(load_config(None, ["--optim.lr=1e-2"]))


# --- discoverable config: each key's help in its field's metadata ---


def test_every_key_has_help():
    helps = key_help()
    assert list(helps) == list(all_keys()) and "init.from" in helps
    assert all(isinstance(h, str) and h.strip() for h in helps.values())


def test_config_text_with_help_parses_back_to_the_same_config(tmp_path: Path):
    cfg = load_config(
        "configs/tiny-cpu.toml", ["--optim.lr=1e-3", "--init.from=hf:x", "--train.compile=true"]
    )
    text = config_text_with_help(cfg)
    assert all(f"# {h}" in text for h in key_help().values())
    assert tomllib.loads(text)["optim"]["lr"] == 1e-3
    (tmp_path / "c.toml").write_text(text)
    assert load_config(tmp_path / "c.toml") == cfg


def test_keys_reference_lists_every_key_with_type_default_and_help():
    text = keys_reference()
    assert '--optim.lr  (float >= 0, default "auto")' in text and "peak learning rate" in text
    assert "--optim.beta2  (float in [0, 1), default 0.95)" in text
    assert all(f"--{key} " in text for key in all_keys())


def test_bare_boolean_flag_means_true():
    assert parse_overrides(["--train.compile"]) == [("train.compile", "true")]
    assert parse_overrides(["--train.compile", "--log.sequences", "off"]) == [
        ("train.compile", "true"),
        ("log.sequences", "off"),
    ]
    assert load_config(None, ["--train.compile", "--optim.lr=1"]).train.compile == "true"
    assert load_config(None, ["--train.compile", "false"]).train.compile == "false"
    with pytest.raises(UserError, match=r"'--train\.max_steps' needs a value"):
        load_config(None, ["--train.max_steps"])


def test_hyphens_and_underscores_are_the_same_in_keys(tmp_path: Path):
    assert load_config(None, ["--train.max-steps=5"]).train.max_steps == 5
    (tmp_path / "c.toml").write_text("[train]\nmax-steps = 7\n")
    assert load_config(tmp_path / "c.toml").train.max_steps == 7


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("optim.learning_rate", ["optim.lr"]),
        ("train.batch_size", ["train.micro_batch", "train.global_batch"]),
        ("model.hidden_size", ["model.d_model"]),
        ("model.num_layers", ["model.n_layer"]),
        ("train.steps", ["train.max_steps"]),
        ("train.lr", ["optim.lr"]),
        ("optim.warmup", ["optim.warmup_steps"]),
        ("optim.lrr", ["optim.lr"]),
    ],
)
def test_unknown_keys_suggest_by_words_and_letters(typed: str, meant: list[str]):
    with pytest.raises(UserError) as e:
        load_config(None, [f"--{typed}=1"])
    message = str(e.value)
    assert message.startswith(f"command line: unknown config key '{typed}'; did you mean '{meant[0]}' (")
    assert all(f"'{k}' (" in message for k in meant) and "\n" not in message


def test_unknown_key_far_from_any_lists_sections_or_the_sections_keys():
    with pytest.raises(UserError, match=r"unknown config key 'foo\.bar'; valid sections: model, init, data"):
        load_config(None, ["--foo.bar=1"])
    with pytest.raises(
        UserError, match=r"unknown config key 'model\.xyz'; keys of \[model\]: arch, vocab_size"
    ):
        load_config(None, ["--model.xyz=1"])


# --- `pretrainer config`, `train --help`, and the command line's bare flags ---


def test_config_verb_prints_commented_toml_with_overrides(capsys):
    assert main(["config", "configs/tiny-cpu.toml", "--optim.lr", "2e-3", "--train.compile"]) == 0
    out = capsys.readouterr().out
    raw = tomllib.loads(out)
    assert (
        raw["optim"]["lr"] == 2e-3 and raw["train"]["compile"] == "true" and raw["train"]["max_steps"] == 360
    )
    assert "# peak learning rate" in out


def test_config_verb_takes_the_vocab_from_the_data(capsys, tmp_path: Path):
    from pretrainer.data.prepare import prepare
    from pretrainer.data.sources import Corpus

    prepare(
        Corpus(["stdlib"]), "bpe:300", tmp_path / "data", val_fraction=0.1, seed=0, workers=1, max_docs=40
    )
    capsys.readouterr()  # prepare's own report
    assert main(["config", f"--data.dir={tmp_path / 'data'}"]) == 0
    # the tokenizer's 300, padded to a multiple of 128: the embedding and output projection are matmuls
    assert tomllib.loads(capsys.readouterr().out)["model"]["vocab_size"] == 384


def test_the_vocabulary_and_loss_chunks_are_aligned_to_128():
    """GPT-2's 50,257 tokens become 50,304 rows when the size comes from the data; a model continued
    from (init.from) keeps its own size unless the data needs more; loss chunks are multiples of 128
    (5,341 tokens at 50,257 before)."""
    from types import SimpleNamespace

    from pretrainer.config.resolve import padded_vocab_size, resolve
    from pretrainer.config.schema import ModelConfig
    from pretrainer.model.loss import loss_chunk_tokens

    assert [padded_vocab_size(n) for n in (50257, 50304, 128, 1, 4096)] == [50304, 50304, 128, 128, 4096]
    data = SimpleNamespace(vocab_size=50257, manifest={"max_token_id": 50256}, path="data", is_chat=False)
    cfg = load_config(None, ["--train.max_steps=1"])
    assert resolve(cfg, data=data).model.vocab_size == 50304
    source = ModelConfig(vocab_size=50257)
    assert resolve(cfg, data=data, source=source, source_where="init.from=x").model.vocab_size == 50257
    chat = SimpleNamespace(vocab_size=50260, manifest={"max_token_id": 50259}, path="data", is_chat=True)
    assert resolve(cfg, data=chat, source=source, source_where="init.from=x").model.vocab_size == 50304
    for vocab in (50304, 50257, 131072, 4096, 256):
        assert loss_chunk_tokens(vocab) % 128 == 0 and loss_chunk_tokens(vocab) * vocab <= 2**28
    assert loss_chunk_tokens(50304) == 5248
    # a run trained before the padding resumes with its own 50,257 rows, not refused as another model
    from pretrainer.config.keys import to_dict
    from pretrainer.config.resolve import resume_changes

    trained = resolve(load_config(None, ["--train.max_steps=1", "--model.vocab_size=50257"]))
    now = resolve(cfg, data=data)
    assert resume_changes(now, to_dict(trained), Path("ckpt"), "pretrainer train") == []
    assert now.model.vocab_size == 50257


def test_config_verb_without_data_dir_notes_it_and_keeps_vocab_0(capsys, tmp_path: Path):
    assert main(["config", f"--data.dir={tmp_path / 'nope'}"]) == 0
    captured = capsys.readouterr()
    assert tomllib.loads(captured.out)["model"]["vocab_size"] == 0 and "note:" in captured.err


def test_train_help_lists_every_key_with_its_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert (
        '--optim.lr  (float >= 0, default "auto")' in out
        and "peak learning rate" in out
        and "pretrainer config" in out
    )
    assert all(f"--{key} " in out for key in all_keys())


def test_bare_boolean_flag_on_the_command_line(capsys):
    """Before the positional config path it is a flag, not that path taken as its value."""
    assert main(["config", "--train.compile", "configs/tiny-cpu.toml", "--ckpt.keep_best", "false"]) == 0
    raw = tomllib.loads(capsys.readouterr().out)
    assert (
        raw["train"]["compile"] == "true"
        and raw["ckpt"]["keep_best"] is False
        and raw["train"]["max_steps"] == 360
    )


def test_track_backends_from_toml_and_the_command_line_and_the_keys_they_replaced(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[track]\nbackends = ["tensorboard", "wandb"]\n')
    assert load_config(path).track.backends == ["tensorboard", "wandb"]
    assert load_config(path, ["--track.backends=mlflow,wandb"]).track.backends == ["mlflow", "wandb"]
    assert load_config(None, ["--track.backends=none"]).track.backends == []
    with pytest.raises(UserError, match=r"track.backends = \['mlflow', 'neptune'\] is not allowed: .*wandb"):
        load_config(None, ["--track.backends=mlflow,neptune"])
    # a run saved by an earlier version ([mlflow] enabled, uri, experiment) reads as the keys replacing them
    path.write_text('[mlflow]\nenabled = false\nexperiment = "x1"\n[track]\nbackends = ["tensorboard"]\n')
    old = load_config(path)
    assert old.track.backends == ["tensorboard"] and old.track.experiment == "x1"
    assert load_config(None, ["--mlflow.enabled=true"]).track.backends == ["mlflow"]


@pytest.mark.parametrize(
    "override, allowed",
    [
        ("--optim.lr=inf", "a finite number >= 0"),
        ("--optim.lr=1e400", "a finite number >= 0"),
        ("--optim.lr=nan", "a finite number >= 0"),
        ("--optim.lr=-1", "a finite number >= 0"),
        ("--optim.weight_decay=nan", "a finite number >= 0"),
        ("--model.init_std=inf", "a finite number > 0"),
        ("--model.rope_theta=nan", "a finite number >= 1"),
        ("--model.norm_eps=-1", "a finite number > 0"),
        ("--train.grad_clip=nan", "a finite number >= 0"),
        ("--train.grad_clip=-1", "a finite number >= 0"),
        ("--optim.warmup_steps=-10", "an integer >= -1"),
        ("--train.stop_at_step=-3", "an integer >= 0"),
        ("--optim.beta2=1.5", r"a finite number in \[0, 1\)"),
        ("--train.seed=-1", r"an integer in \[0, 4294967295\]"),
        ("--model.arch=gpt3", "one of llama, gpt2"),
    ],
)
def test_out_of_range_values_are_one_line_naming_key_value_and_range(override: str, allowed: str):
    key = override[2:].split("=")[0]
    with pytest.raises(UserError, match=rf"^command line: {key} = .* is not allowed: it must be {allowed}$"):
        load_config(None, [override])


def test_integer_overflow_and_huge_strings_are_one_line(tmp_path: Path):
    with pytest.raises(UserError, match=r"^command line: 'train.max_steps' must be int, got '1e400'$"):
        load_config(None, ["--train.max_steps=1e400"])
    with pytest.raises(UserError, match=r"is not allowed: it must be an integer > 0$"):
        load_config(None, ["--model.seq_len=100000000000000000000000"])
    path = tmp_path / "huge.toml"
    path.write_text('[model]\nseq_len = "' + "x" * 5_000_000 + '"\n')
    with pytest.raises(UserError) as caught:
        load_config(path)
    assert len(str(caught.value)) < 300 and "5,000,002 characters" in str(caught.value)


def test_hostile_toml_files_are_one_line(tmp_path: Path):
    deep = tmp_path / "deep.toml"
    deep.write_text("[model]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match=r"deep\.toml: (nested too deeply|not valid TOML)"):
        load_config(deep)
    utf16 = tmp_path / "utf16.toml"
    utf16.write_text("[optim]\nlr = 1e-3\n", encoding="utf-16")
    with pytest.raises(UserError, match=r"utf16\.toml: not UTF-8 text .*; save it as UTF-8$"):
        load_config(utf16)
    bom = tmp_path / "bom.toml"
    bom.write_text("[optim]\nlr = 1e-3\n", encoding="utf-8-sig")
    assert load_config(bom).optim.lr == 1e-3


def test_dropout_is_refused_where_chat_data_packs_by_document(tmp_path):
    """data.packing = auto becomes document for chat data, after the config's own checks ran: resolve
    refuses dropout there too (flex attention, the document kernel on a GPU, has no dropout)."""
    from types import SimpleNamespace

    from pretrainer.config.resolve import resolve

    chat = SimpleNamespace(path=tmp_path, manifest={"max_token_id": 99}, vocab_size=100, is_chat=True)
    cfg = load_config(None, ["--model.dropout=0.1", "--train.max_steps=10"])
    with pytest.raises(UserError, match="model.dropout = 0.1 with document packing"):
        resolve(cfg, data=chat)
    text = SimpleNamespace(path=tmp_path, manifest={"max_token_id": 99}, vocab_size=100, is_chat=False)
    assert resolve(cfg, data=text).data.packing == "concat"


def test_context_extension_is_refused_for_a_mixture_in_one_line(tmp_path):
    from pretrainer.config.keys import to_dict
    from pretrainer.config.resolve import resume_changes

    shape = ["--model.vocab_size=128", "--model.d_ff=384", "--train.max_steps=10", "--data.packing=concat"]
    mixed = [f"--data.mixture={tmp_path}/a:0.5,{tmp_path}/b:0.5", *shape]
    saved = to_dict(load_config(None, [*mixed, "--model.seq_len=64"]))
    longer = load_config(None, [*mixed, "--model.seq_len=128"])
    with pytest.raises(UserError, match="not of a mixture's stream"):
        resume_changes(longer, saved, tmp_path, "pretrainer train ...")
    single = [f"--data.dir={tmp_path}/d", *shape]
    saved = to_dict(load_config(None, [*single, "--model.seq_len=64"]))
    changed = resume_changes(load_config(None, [*single, "--model.seq_len=128"]), saved, tmp_path, "")
    assert changed == ["model.seq_len: 64 -> 128"]


def test_a_toml_list_typed_on_the_command_line_is_the_list():
    """The config file's own syntax on the command line was refused; it is parsed as TOML."""
    from pretrainer.config.load import load_config

    cfg = load_config(None, ['--track.backends=["mlflow", "tensorboard"]'])
    assert cfg.track.backends == ["mlflow", "tensorboard"]
    assert load_config(None, ["--track.backends=mlflow,tensorboard"]).track.backends == cfg.track.backends
    with pytest.raises(UserError, match="'track.backends' must be"):
        load_config(None, ['--track.backends=["mlflow",'])


def test_a_config_saved_before_a_key_existed_reads_as_its_run_trained(tmp_path):
    """model.qk_norm (auto: on for llama) and optim.embedding_lr_scale (auto: 10 with Muon) came after
    runs were saved without them. A checkpoint's state.json or a run's config.toml that lacks them reads
    as that run trained (no QK-norm, embeddings at optim.lr); a config file that leaves them out gets
    today's defaults."""
    from pretrainer.artifacts.checkpoint import _same_config
    from pretrainer.artifacts.run_config import load_train_config
    from pretrainer.config.keys import to_dict
    from pretrainer.config.load import from_dict
    from pretrainer.config.resolve import resolve, uses_qk_norm
    from pretrainer.config.toml_text import toml_document

    today = load_config(None, [])
    assert uses_qk_norm(today.model) and today.optim.embedding_lr_scale == 0  # auto
    saved = to_dict(today)
    del saved["model"]["qk_norm"], saved["optim"]["embedding_lr_scale"]
    (tmp_path / "config.toml").write_text(toml_document(saved))
    continued = load_train_config(None, [f"--run.dir={tmp_path}"])  # a run dir continued, nothing retyped
    for cfg in (from_dict(saved, "state.json"), continued):
        assert cfg.model.qk_norm == "false" and not uses_qk_norm(cfg.model)
        assert cfg.optim.embedding_lr_scale == 1.0
    (tmp_path / "mine.toml").write_text(toml_document({"model": {"d_model": 64}}))
    assert uses_qk_norm(load_config(tmp_path / "mine.toml", []).model)
    # init.from such a run (or an HF Llama): auto continues it as it was; asking for QK-norm is refused
    source, base = from_dict(saved, "state.json").model, ["--train.max_steps=1"]
    assert resolve(load_config(None, base), source=source, source_where="x").model.qk_norm == "false"
    with pytest.raises(UserError, match="model.qk_norm = True but the source has False"):
        resolve(load_config(None, [*base, "--model.qk_norm=true"]), source=source, source_where="x")
    # and its checkpoint is still recognised as the run dir's own (the hash of today's keys is not theirs)
    checkpoint = tmp_path / "checkpoints" / "step_00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"config": saved, "config_sha256": "older"}))
    assert _same_config(tmp_path, checkpoint)
    saved["train"]["seed"] += 1
    (checkpoint / "state.json").write_text(json.dumps({"config": saved, "config_sha256": "older"}))
    assert not _same_config(tmp_path, checkpoint)
