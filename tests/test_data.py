"""Tests of the main job's data and model building blocks (hf_diloco.job.data, hf_diloco.job.modeling)."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_diloco.job.data import (
    EOS_TOKEN,
    build_tokenizer,
    check_enough_blocks,
    check_vocab,
    dataset_fingerprint,
    keep_run_tokenizer,
    load_or_train_tokenizer,
    load_text_dataset,
    set_model_max_length,
    split_files,
    split_seed,
    stdlib_corpus_files,
    tokenize_and_group,
    tokenizer_fingerprint,
    train_bpe_tokenizer,
)
from hf_diloco.job.modeling import (
    DEFAULT_MODEL_CONFIG,
    build_model,
    build_model_config,
    check_block_size,
    model_positions,
)

pytestmark = pytest.mark.timeout(120)

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
DOCS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld 世界 \t tabs\n\n\nand blank lines",
    "class A:\n    pass\n",
    "x = [i ** 2 for i in range(10)]  # squares",
    "",
    "import os\nprint(os.sep)\n",
]


@pytest.fixture(scope="module")
def stdlib_files():
    return stdlib_corpus_files()


@pytest.fixture(scope="module")
def tokenizer(stdlib_files):
    texts = [path.read_text(encoding="utf-8") for path in stdlib_files[:20]]
    return train_bpe_tokenizer(texts, vocab_size=512, show_progress=False)


def test_stdlib_corpus_is_found(stdlib_files):
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(stdlib_files) > 100
    assert stdlib_files == sorted(stdlib_files)
    assert root / "os.py" in stdlib_files
    assert root / "json" / "decoder.py" in stdlib_files
    for path in stdlib_files:
        parts = path.relative_to(root).parts
        assert path.suffix == ".py" and path.is_file()
        assert "site-packages" not in parts and "test" not in parts
    with_tests = stdlib_corpus_files(include_tests=True)
    assert set(stdlib_files) < set(with_tests)
    assert any("test" in path.relative_to(root).parts for path in with_tests)


def test_split_files_is_disjoint_and_deterministic():
    files = [Path(f"dir/file_{i:03d}.py") for i in range(200)]
    train, evals = split_files(files, eval_fraction=0.1, seed=3)
    assert len(evals) == 20 and len(train) == 180
    assert not set(train) & set(evals)
    assert set(train) | set(evals) == set(files)
    assert split_files(list(reversed(files)), eval_fraction=0.1, seed=3) == (train, evals)
    assert split_files(files, eval_fraction=0.1, seed=4)[1] != evals
    # Held-out files are a random pick, not simply the first or last ones.
    assert evals != files[:20] and evals != files[-20:]
    assert split_files(files[:3], eval_fraction=0.01)[1] != []
    with pytest.raises(ValueError, match="eval_fraction"):
        split_files(files, eval_fraction=1.0)


def test_tokenizer_round_trips_and_reloads_offline(tokenizer, stdlib_files, tmp_path, monkeypatch):
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOS_TOKEN
    unseen = stdlib_files[-1].read_text(encoding="utf-8")
    for text in [unseen, *DOCS, "emoji 🐍 and \r\n crlf"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # BPE learned merges: common Python source takes far fewer tokens than bytes.
    assert len(tokenizer(unseen)["input_ids"]) < len(unseen.encode()) / 2

    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(reloaded) == len(tokenizer)
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert reloaded(unseen)["input_ids"] == tokenizer(unseen)["input_ids"]
    assert reloaded.decode(reloaded(unseen)["input_ids"]) == unseen

    from_spec = build_tokenizer({"path": str(tmp_path)}, texts=[])
    assert from_spec(DOCS[1])["input_ids"] == tokenizer(DOCS[1])["input_ids"]
    trained = build_tokenizer({"vocab_size": 300, "max_train_samples": 2}, texts=DOCS)
    assert len(trained) <= 300
    with pytest.raises(ValueError, match="empty corpus"):
        build_tokenizer({"vocab_size": 300}, texts=iter([]))
    with pytest.raises(ValueError, match="Unknown key"):
        build_tokenizer({"vocab": 300}, texts=DOCS)


def _reference_blocks(docs, tokenizer, block_size, group_size):
    """Independent packing: tokenize each group of documents joined by EOS as ONE string, cut, drop the tail."""
    blocks = []
    for start in range(0, len(docs), group_size):
        joined = "".join(doc + EOS_TOKEN for doc in docs[start : start + group_size])
        stream = tokenizer(joined, add_special_tokens=False)["input_ids"]
        blocks += [stream[i : i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    return blocks


@pytest.mark.parametrize("group_batch_size", [1000, 2])
def test_tokenize_and_group_packs_documents_with_eos(tokenizer, group_batch_size):
    from datasets import Dataset

    docs = DOCS * 5
    dataset = Dataset.from_dict({"text": docs, "other": list(range(len(docs)))})
    blocks = tokenize_and_group(dataset, tokenizer, block_size=7, group_batch_size=group_batch_size)
    assert blocks.column_names == ["input_ids", "labels"]
    expected = _reference_blocks(docs, tokenizer, 7, group_batch_size)
    assert len(expected) > 10
    assert list(blocks["input_ids"]) == expected
    assert list(blocks["labels"]) == expected
    assert all(len(block) == 7 for block in blocks["input_ids"])
    if group_batch_size == 1000:
        stream = [token for block in expected for token in block]
        assert stream.count(tokenizer.eos_token_id) >= len(docs) - 1


def test_load_text_dataset_local_text_files(tmp_path, tokenizer):
    (tmp_path / "train.txt").write_text("\n".join(f"train line {i}" for i in range(30)) + "\n")
    (tmp_path / "valid.txt").write_text("valid line a\nvalid line b\n")
    spec = {
        "path": "text",
        "data_files": {"train": str(tmp_path / "train.txt"), "validation": str(tmp_path / "valid.txt")},
        "max_train_samples": 12,
        "block_size": 8,
    }
    raw = load_text_dataset(spec)
    assert set(raw) == {"train", "validation"}
    assert list(raw["validation"]["text"]) == ["valid line a", "valid line b"]
    assert len(raw["train"]) == 12
    assert set(raw["train"]["text"]) < {f"train line {i}" for i in range(30)}
    assert list(load_text_dataset(spec)["train"]["text"]) == list(raw["train"]["text"])
    blocks = tokenize_and_group(raw, tokenizer, block_size=spec["block_size"])
    assert len(blocks["train"]) > 0 and len(blocks["train"][0]["input_ids"]) == 8


def test_load_text_dataset_local_json_with_held_out_split(tmp_path):
    rows = [{"content": f"document number {i}", "id": i} for i in range(50)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    spec = {"path": "json", "data_files": str(path), "text_column": "content", "validation_split_percentage": 20}
    raw = load_text_dataset(spec)
    assert raw["train"].column_names == ["text"] and raw["validation"].column_names == ["text"]
    assert len(raw["validation"]) == 10 and len(raw["train"]) == 40
    assert sorted([*raw["train"]["text"], *raw["validation"]["text"]]) == sorted(row["content"] for row in rows)
    single = load_text_dataset({**spec, "split": "train", "seed": 1})
    assert len(single["validation"]) == 10 and list(single["validation"]["text"]) != list(raw["validation"]["text"])
    with pytest.raises(ValueError, match="no column 'body'"):
        load_text_dataset({**spec, "text_column": "body"})
    with pytest.raises(ValueError, match="train split of the data is empty"):
        load_text_dataset({**spec, "max_train_samples": 0})


def test_load_text_dataset_default_is_stdlib():
    raw = load_text_dataset({"max_train_samples": 5, "max_eval_samples": 3, "block_size": 64})
    assert len(raw["train"]) == 5 and len(raw["validation"]) == 3
    assert raw["train"].column_names == ["text"]
    assert all(text.strip() for text in [*raw["train"]["text"], *raw["validation"]["text"]])
    assert list(load_text_dataset({"max_train_samples": 5})["train"]["text"]) == list(raw["train"]["text"])
    with pytest.raises(ValueError, match="Unknown key.*max_train_file"):
        load_text_dataset({"max_train_file": 5})
    with pytest.raises(ValueError, match="data.source"):
        load_text_dataset({"source": "web"})


def test_check_enough_blocks():
    check_enough_blocks(16, num_shards=2, batch_size=8)
    with pytest.raises(ValueError, match=r"15 blocks.*need at least 16.*smaller `data.block_size`"):
        check_enough_blocks(15, num_shards=2, batch_size=8)


def test_check_vocab(tokenizer):
    check_vocab(tokenizer, LlamaConfig(vocab_size=512))
    with pytest.raises(ValueError, match="tokenizer has 512 tokens but the model's vocabulary has 500"):
        check_vocab(tokenizer, LlamaConfig(vocab_size=500))


def test_build_model_default(tokenizer):
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = build_model(None, len(tokenizer), *ids, seed=0)
    assert isinstance(model, LlamaForCausalLM) and model.training
    config = model.config
    for key, value in DEFAULT_MODEL_CONFIG.items():
        if key != "model_type":
            assert getattr(config, key) == value, key
    assert config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    same = build_model({}, len(tokenizer), *ids, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    batch = torch.tensor([tokenizer("def f(x):\n    return x\n")["input_ids"]])
    loss = model(input_ids=batch, labels=batch).loss
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 1.0


def test_build_model_from_config_dict():
    spec = {"config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}}
    model = build_model(spec, 300, eos_token_id=0, pad_token_id=0)
    assert isinstance(model, GPT2LMHeadModel)
    assert (model.config.vocab_size, model.config.n_layer, model.config.eos_token_id) == (300, 2, 0)
    assert model.get_input_embeddings().weight.shape == (300, 32)
    assert build_model({"config": {**TINY_LLAMA, "vocab_size": 400}}, 300).config.vocab_size == 400
    assert next(build_model({"config": TINY_LLAMA, "dtype": "bfloat16"}, 300).parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model_type"):
        build_model({"config": {"hidden_size": 32}}, 300)
    with pytest.raises(ValueError, match="300 tokens but the model's vocabulary has 100"):
        build_model({"config": {**TINY_LLAMA, "vocab_size": 100}}, 300)
    with pytest.raises(ValueError, match="Unknown key"):
        build_model({"confg": TINY_LLAMA}, 300)


def test_build_model_from_local_folder(tmp_path):
    saved = build_model({"config": TINY_LLAMA}, 300, seed=1)
    saved.save_pretrained(tmp_path)

    loaded = build_model({"model_name_or_path": str(tmp_path)}, 300)
    assert isinstance(loaded, LlamaForCausalLM) and loaded.training
    saved_state = saved.state_dict()
    assert all(torch.equal(tensor, saved_state[name]) for name, tensor in loaded.state_dict().items())

    fresh = build_model({"config_name": str(tmp_path), "config": {"num_hidden_layers": 1}}, 300, seed=2)
    assert (fresh.config.hidden_size, fresh.config.num_hidden_layers) == (32, 1)
    assert not torch.equal(fresh.model.embed_tokens.weight, saved.model.embed_tokens.weight)

    with pytest.raises(ValueError, match="400 tokens but the model's vocabulary has 300"):
        build_model({"model_name_or_path": str(tmp_path)}, 400)
    with pytest.raises(ValueError, match="only one"):
        build_model({"model_name_or_path": str(tmp_path), "config_name": str(tmp_path)}, 300)


def test_tokenizer_max_length_comes_from_the_model_positions(tmp_path):
    """A trained tokenizer claims no limit (1e30); set from the model, the saved tokenizer truncates to its positions."""
    tokenizer = train_bpe_tokenizer(["def f(x):\n    return x\n"] * 4, vocab_size=300, show_progress=False)
    assert tokenizer.model_max_length > 1e20
    assert model_positions(GPT2Config(n_positions=32)) == 32
    set_model_max_length(tokenizer, LlamaConfig(max_position_embeddings=64))
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.model_max_length == 64
    assert len(reloaded("x " * 1600, truncation=True)["input_ids"]) == 64


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", r"The data file .*corpus\.txt is empty \(data\.data_files\)"),
        (b"\n  \n\n", r"The data file .*corpus\.txt is empty"),
        (b"text\x00\x01\x02binary" * 10, r"corpus\.txt is not UTF-8 text \(a NUL byte at byte 4\); it looks binary"),
        ("caf\u00e9".encode("latin-1") + b" au lait\n", r"corpus\.txt is not UTF-8 text \(byte 3: invalid"),
    ],
    ids=["empty", "blank", "binary", "latin-1"],
)
def test_an_empty_or_binary_corpus_file_is_named_before_loading(tmp_path, content, expected):
    (tmp_path / "good.txt").write_text("a line of text\n" * 20)
    (tmp_path / "corpus.txt").write_bytes(content)
    with pytest.raises(ValueError, match=expected):
        load_text_dataset({"path": "text", "data_files": [str(tmp_path / "good.txt"), str(tmp_path / "corpus.txt")]})
    with pytest.raises(ValueError, match=expected):  # found through a glob and a split mapping too
        load_text_dataset({"path": "text", "data_files": {"train": str(tmp_path / "*.txt")}})


def test_rows_without_text_are_named_before_tokenizing(tmp_path):
    rows = [{"text": f"document {i}"} for i in range(20)]
    rows[7]["text"] = None
    rows[12]["text"] = None
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(ValueError, match=r"2 of 20 rows of the train split \(data.path='json'.*corpus\.jsonl.*\) have "
                       r"no text \(null in column 'text'\); the first is row 7\. Remove or fill"):  # fmt: skip
        load_text_dataset({"path": "json", "data_files": str(path)})
    path.write_text("\n".join(json.dumps({"text": i}) for i in range(20)))
    with pytest.raises(ValueError, match=r"Column 'text' of the train split .* holds int64, not text"):
        load_text_dataset({"path": "json", "data_files": str(path)})


def test_misspelt_model_config_keys_are_named_with_the_closest_valid_one(tmp_path):
    with pytest.raises(ValueError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\).*LlamaConfig"):
        build_model({"config": {**TINY_LLAMA, "hiden_size": 64}}, 300)
    with pytest.raises(ValueError, match=r"'n_positon' \(did you mean 'n_positions'\?\)"):
        build_model({"config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positon": 8}}, 300)
    with pytest.raises(ValueError, match=r"model_type 'lama'\. Did you mean 'llama'\?"):
        build_model({"config": {**TINY_LLAMA, "model_type": "lama"}}, 300)
    build_model({"config": TINY_LLAMA}, 300).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'num_hiden_layers' \(did you mean 'num_hidden_layers'\?\)"):
        build_model({"config_name": str(tmp_path), "config": {"num_hiden_layers": 1}}, 300)
    # Names the config class converts (legacy rope keys) and aliases of an attribute_map are valid.
    legacy = build_model_config({"config": {**TINY_LLAMA, "rope_theta": 5e5}}, 300)
    assert legacy.rope_parameters["rope_theta"] == 5e5
    alias = build_model_config({"config": {"model_type": "gpt2", "hidden_size": 48, "n_head": 2}}, 300)
    assert alias.n_embd == 48


def test_blocks_longer_than_the_models_positions_are_refused():
    check_block_size(64, build_model_config({"config": TINY_LLAMA}, 300))
    with pytest.raises(ValueError, match=r"data.block_size is 65 tokens but the model has only 64 positions "
                       r"\(`max_position_embeddings` of its 'llama' config\)\. Lower `data.block_size` to at most 64"):  # fmt: skip
        check_block_size(65, build_model_config({"config": TINY_LLAMA}, 300))
    gpt2 = build_model_config({"config": {"model_type": "gpt2", "n_embd": 32, "n_positions": 16, "n_head": 2}}, 300)
    with pytest.raises(ValueError, match=r"only 16 positions \(`n_positions` of its 'gpt2' config\)"):
        check_block_size(32, gpt2)


def test_the_runs_tokenizer_is_trained_once_and_never_retrained(tmp_path):
    folder = tmp_path / "out" / "tokenizer"
    folder.parent.mkdir()
    spec = {"vocab_size": 300}
    first = load_or_train_tokenizer(folder, spec, DOCS * 3)
    assert (folder / "tokenizer.json").is_file() and not list(folder.parent.glob(".tokenizer.tmp-*"))
    # Until its run starts training it is provisional: another start trains it again, from its own texts.
    other_texts = ["zzzz qqqq " * 50, "completely different words"] * 10
    retrained = load_or_train_tokenizer(folder, spec, other_texts)
    reference = build_tokenizer(spec, other_texts)
    assert tokenizer_fingerprint(retrained) == tokenizer_fingerprint(reference) != tokenizer_fingerprint(first)
    assert not list(folder.parent.glob(".tokenizer.*"))
    first = load_or_train_tokenizer(folder, spec, DOCS * 3)
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(build_tokenizer(spec, DOCS * 3))
    # Another rank of the same start loads what rank 0 trained, provisional or not.
    assert tokenizer_fingerprint(load_or_train_tokenizer(folder, spec, other_texts, retrain_provisional=False)) == (
        tokenizer_fingerprint(first)
    )
    keep_run_tokenizer(folder)  # training started: the tokenizer is the run's for good
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    # A resume with other data: the saved tokenizer, not a new one; nothing is written.
    again = load_or_train_tokenizer(folder, spec, other_texts)
    assert again.get_vocab() == first.get_vocab()
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(first)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert tokenizer_fingerprint(train_bpe_tokenizer(other_texts, vocab_size=300, show_progress=False)) != (
        tokenizer_fingerprint(first)
    )
    with pytest.raises(ValueError, match=r"trained with `tokenizer:` \{'vocab_size': 300\}, but the config now says "
                       r"\{'vocab_size': 512\}.*another --output_dir"):  # fmt: skip
        load_or_train_tokenizer(folder, {"vocab_size": 512}, DOCS)
    saved = json.loads((folder / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    first_token, last_token = min(vocab, key=vocab.get), max(vocab, key=vocab.get)
    vocab[first_token], vocab[last_token] = vocab[last_token], vocab[first_token]  # two ids swapped
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="changed after this run trained them"):
        load_or_train_tokenizer(folder, spec, DOCS)
    stray = tmp_path / "stray"
    stray.mkdir()
    with pytest.raises(ValueError, match=r"holds no tokenizer trained by this run.*tokenizer: path:"):
        load_or_train_tokenizer(stray, spec, DOCS)


def test_dataset_fingerprint_follows_the_blocks(tokenizer):
    from datasets import Dataset

    blocks = tokenize_and_group(Dataset.from_dict({"text": DOCS * 5}), tokenizer, block_size=7)
    assert dataset_fingerprint(blocks) == dataset_fingerprint(Dataset.from_dict(blocks.to_dict()))
    assert dataset_fingerprint(blocks) != dataset_fingerprint(blocks.select(range(len(blocks) - 1)))
    changed = blocks.to_dict()
    changed["input_ids"][0] = [0] * 7
    assert dataset_fingerprint(blocks) != dataset_fingerprint(Dataset.from_dict(changed))
    assert dataset_fingerprint(blocks.select([])) == dataset_fingerprint(blocks.select([]))


def test_split_seed_is_the_sections_own_else_data_seed_else_seed():
    assert split_seed({"seed": 5}, 42, 7)["seed"] == 5
    assert split_seed({"source": "stdlib"}, 42, 7) == {"source": "stdlib", "seed": 7}
    assert split_seed(None, 42)["seed"] == 42


def test_the_main_jobs_seed_sets_the_held_out_files_the_order_and_the_init(tmp_path):
    """`hf-diloco pretrain --seed N` (the Trainer's seed): the held-out files, the Trainer's batch order and the
    initialization follow it; the same seed repeats them; `--data_seed` sets the data alone (HF's meaning)."""
    import yaml

    from hf_diloco.cli import pretrain
    from hf_diloco.cli.pretrain_arguments import parse_command_line
    from hf_diloco.job.config_file import shipped_config_text

    config = yaml.safe_load(shipped_config_text("tiny_diloco"))
    config["data"].update(max_train_samples=12, max_eval_samples=2, block_size=64)
    config["tokenizer"]["vocab_size"] = 512
    config["model"]["config"].update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))

    def start(name: str, *flags: str) -> tuple[list, list, torch.Tensor]:
        """What a start of the job reads first: a held-out block, the first two batches, a weight of the model."""
        command = parse_command_line(
            ["--config", str(tmp_path / "job.yaml"), "--use_cpu", "--output_dir", str(tmp_path / name), *flags]
        )
        config, args = command.config, command.args
        tokenizer, blocks = pretrain.build_datasets(config, args, pretrain.JobGlobalPoints(None, 60.0, "bound"))
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        model = build_model(config.section("model"), len(tokenizer), *ids, seed=args.seed)
        loader = pretrain.build_trainer(config, args, model, tokenizer, blocks).get_train_dataloader()
        batches = [batch["input_ids"].tolist() for _, batch in zip(range(2), loader)]
        return blocks["validation"]["input_ids"][0], batches, next(model.parameters()).detach().clone()

    one, again, other = start("a", "--seed", "1"), start("b", "--seed", "1"), start("c", "--seed", "2")
    assert one[:2] == again[:2] and torch.equal(one[2], again[2])
    assert one[0] != other[0] and one[1] != other[1] and not torch.equal(one[2], other[2])
    data_of_one = start("d", "--seed", "2", "--data_seed", "1")
    assert data_of_one[:2] == one[:2] and torch.equal(data_of_one[2], other[2])
