"""Data building blocks for the main pretraining job (`scripts/pretrain.py`).

The default corpus is the Python standard library's own source code (found with `sysconfig`, so it is present on
every machine that runs Python and needs no network), tokenized with a byte-level BPE tokenizer trained on the fly
with the `tokenizers` library. Any `datasets.load_dataset` source (a Hub dataset name, or a local `text`/`json`/...
builder with `data_files`) replaces it from the `data:` section of the YAML config.

Typical use:

```python
files = stdlib_corpus_files()  # the default corpus: sorted .py paths of this interpreter's stdlib
raw = load_text_dataset({"max_train_samples": 150})  # DatasetDict with "train" and "validation", column "text"
tokenizer = build_tokenizer({"vocab_size": 4096}, raw["train"]["text"])  # trains on the training split only
blocks = tokenize_and_group(raw, tokenizer, block_size=256)  # columns "input_ids" and "labels"
check_enough_blocks(len(blocks["train"]), num_shards=world_size, batch_size=8)
```
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import random
import shutil
import sysconfig
from collections.abc import Iterable, Mapping, Sequence, Sized
from itertools import chain, islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..core.settings.config import check_known_keys
from .modeling import check_vocab_size, model_positions

logger = logging.getLogger(__name__)

__all__ = [
    "DATA_SPEC_KEYS",
    "EOS_TOKEN",
    "TOKENIZER_SPEC_KEYS",
    "build_tokenizer",
    "check_enough_blocks",
    "check_vocab",
    "dataset_fingerprint",
    "keep_run_tokenizer",
    "load_or_train_tokenizer",
    "load_text_dataset",
    "set_model_max_length",
    "split_seed",
    "split_files",
    "stdlib_corpus_files",
    "tokenize_and_group",
    "tokenizer_fingerprint",
    "train_bpe_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"

# Keys of the YAML `data:` section. The last group is read by the caller (tokenization), not by `load_text_dataset`,
# but listing them here lets a typo in any key fail loudly instead of being ignored.
DATA_SPEC_KEYS = frozenset(
    {
        "source",
        "include_tests",
        "path",
        "name",
        "data_files",
        "data_dir",
        "split",
        "validation_split",
        "validation_split_percentage",
        "text_column",
        "max_train_samples",
        "max_eval_samples",
        "seed",
        "block_size",
        "num_proc",
        "group_batch_size",
    }
)
TOKENIZER_SPEC_KEYS = frozenset({"path", "vocab_size", "min_frequency", "max_train_samples"})
# Written next to a tokenizer that `load_or_train_tokenizer` trained: the `tokenizer:` section, the fingerprint and,
# until its run starts training (`keep_run_tokenizer`), `provisional: true`.
TOKENIZER_RECORD_NAME = "hf_diloco_tokenizer.json"

# Builders that read UTF-8 text files, whose files are checked before loading; compressed files are left to them.
_TEXT_BUILDERS = frozenset({"text", "json", "csv"})
_COMPRESSED_SUFFIXES = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".tar"})
_SNIFFED_BYTES = 1 << 16

_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_corpus_files(include_tests: bool = False) -> list[Path]:
    """
    List the `.py` source files of the running interpreter's standard library.

    Args:
        include_tests (`bool`, *optional*, defaults to `False`):
            Whether to keep files under `test`/`tests`/`idle_test` directories (about two thirds of the stdlib's
            source, and much of it generated data rather than code).

    Returns:
        `list[Path]`: the files, sorted by path (deterministic for a given Python install). Installed third-party
        packages (`site-packages`, `dist-packages`) are never included.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = _STDLIB_SKIPPED_DIRS if include_tests else _STDLIB_SKIPPED_DIRS | _STDLIB_TEST_DIRS
    files = [
        path
        for path in root.rglob("*.py")
        if path.is_file() and not skipped.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files)


def split_files(files: Sequence[Path], eval_fraction: float = 0.05, seed: int = 0) -> tuple[list[Path], list[Path]]:
    """
    Hold out whole files for evaluation, so no evaluation text is ever seen in training.

    Args:
        files (`Sequence[Path]`): the corpus files.
        eval_fraction (`float`, *optional*, defaults to 0.05): fraction of the files held out, in `[0, 1)`. At least
            one file is held out when there are two or more files and the fraction is positive.
        seed (`int`, *optional*, defaults to 0): seed of the shuffle that picks the held-out files.

    Returns:
        `tuple[list[Path], list[Path]]`: `(train_files, eval_files)`, disjoint, each sorted; the same inputs always
        give the same split, whatever the order of `files`.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
    ordered = sorted(set(files))
    num_eval = round(len(ordered) * eval_fraction)
    if eval_fraction > 0 and len(ordered) >= 2:
        num_eval = min(max(num_eval, 1), len(ordered) - 1)
    shuffled = list(ordered)
    random.Random(seed).shuffle(shuffled)
    eval_files = set(shuffled[:num_eval])
    return [f for f in ordered if f not in eval_files], [f for f in ordered if f in eval_files]


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 4096,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    show_progress: bool = True,
    length: int | None = None,
) -> PreTrainedTokenizerFast:
    """
    Train a byte-level BPE tokenizer (the GPT-2 scheme: any text round-trips, no unknown token) on `texts`.

    Args:
        texts (`Iterable[str]`): the training documents.
        vocab_size (`int`, *optional*, defaults to 4096): the largest vocabulary, special tokens included; a small
            corpus may yield fewer merges.
        min_frequency (`int`, *optional*, defaults to 2): a pair seen fewer times is never merged.
        special_tokens (`Sequence[str]`, *optional*, defaults to `("<|endoftext|>",)`): the first one serves as the
            BOS, EOS and padding token.
        show_progress (`bool`, *optional*, defaults to `True`): show the `tokenizers` progress bar.
        length (`int`, *optional*): number of texts, only used by the progress bar.

    Returns:
        `PreTrainedTokenizerFast`: ready to `save_pretrained` and reload with `AutoTokenizer.from_pretrained`.
    """
    if not special_tokens:
        raise ValueError("train_bpe_tokenizer needs at least one special token (used as BOS/EOS/padding).")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    eos = special_tokens[0]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=eos,
        eos_token=eos,
        pad_token=eos,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(spec: Mapping[str, Any] | None, texts: Iterable[str]) -> PreTrainedTokenizerBase:
    """
    Build the tokenizer described by the YAML `tokenizer:` section.

    Args:
        spec (`Mapping[str, Any]`, *optional*): either `{"path": <folder or Hub name>}` to load an existing tokenizer
            with `AutoTokenizer.from_pretrained`, or `{"vocab_size": ..., "min_frequency": ...,
            "max_train_samples": ...}` to train a byte-level BPE tokenizer on `texts` (the default, vocab 4096).
        texts (`Iterable[str]`): the training documents, for example `raw["train"]["text"]` (ignored when `path` is
            given). Train on the training split only, so the evaluation text stays unseen.

    Returns:
        `PreTrainedTokenizerBase`: a tokenizer with an EOS token (a loaded one without a padding token gets EOS as
        padding).
    """
    spec = dict(spec or {})
    check_known_keys(spec, sorted(TOKENIZER_SPEC_KEYS), "the tokenizer: section")
    if spec.get("path"):
        tokenizer = AutoTokenizer.from_pretrained(spec["path"])
        if tokenizer.eos_token_id is None:
            raise ValueError(f"The tokenizer at {spec['path']!r} has no EOS token, which separates documents.")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
    length = len(texts) if isinstance(texts, Sized) else None
    max_samples = spec.get("max_train_samples")
    if max_samples is not None:
        texts = islice(texts, max_samples)
        length = None if length is None else min(length, max_samples)
    texts = iter(texts)
    first = next(texts, None)
    if first is None:
        raise ValueError("Cannot train a tokenizer on an empty corpus.")
    return train_bpe_tokenizer(
        chain([first], texts),
        vocab_size=spec.get("vocab_size", 4096),
        min_frequency=spec.get("min_frequency", 2),
        length=length,
    )


def load_text_dataset(spec: Mapping[str, Any] | None = None) -> DatasetDict:
    """
    Load the raw text corpus described by the YAML `data:` section.

    Args:
        spec (`Mapping[str, Any]`, *optional*): the `data:` section. Keys:

            - `source`: `"stdlib"` (the default when there is no `path`) or `"datasets"` (the default with a `path`).
            - `include_tests` (stdlib): also use the stdlib's test files (default `False`).
            - `path`, `name`, `data_files`, `data_dir`, `split`: passed to `datasets.load_dataset`; `path` is a Hub
              dataset name, a local dataset folder, or a builder such as `"text"`/`"json"`/`"csv"` with
              `data_files`.
            - `validation_split`: name of the evaluation split (default `"validation"`).
            - `validation_split_percentage`: percentage of the training rows (or, for stdlib, files) held out when
              there is no evaluation split (default 5).
            - `text_column`: the column holding the text (default `"text"`).
            - `max_train_samples`, `max_eval_samples`: keep a seeded random subset of this many rows (stdlib: files).
            - `seed`: seed of the held-out split and of the subsets (default 0; the main job's default is the
              Trainer's `data_seed`, else its `seed`: `split_seed`).
            - `block_size`, `num_proc`, `group_batch_size`: read by the caller for `tokenize_and_group`.

    Returns:
        `DatasetDict`: splits `"train"` and `"validation"`, each with the single column `"text"`.
    """
    spec = dict(spec or {})
    check_known_keys(spec, sorted(DATA_SPEC_KEYS), "the data: section")
    source = spec.get("source", "datasets" if spec.get("path") else "stdlib")
    seed = spec.get("seed", 0)
    percentage = spec.get("validation_split_percentage", 5)
    if source == "stdlib":
        raw = _load_stdlib(spec, percentage / 100, seed)
    elif source == "datasets":
        raw = _load_with_datasets(spec, percentage / 100, seed)
    else:
        raise ValueError(f"data.source must be 'stdlib' or 'datasets', got {source!r}.")
    raw = DatasetDict(
        train=_subset(raw["train"], spec.get("max_train_samples"), seed),
        validation=_subset(raw["validation"], spec.get("max_eval_samples"), seed),
    )
    for split, dataset in raw.items():
        if len(dataset) == 0:
            raise ValueError(f"The {split} split of the data is empty; check the `data:` section of the config.")
    return raw


def split_seed(spec: Mapping[str, Any] | None, seed: int, data_seed: int | None = None) -> dict[str, Any]:
    """
    The `data:` section with the seed of its held-out split and subsets decided: its own `seed` when it sets one,
    else the Trainer's `data_seed` when set, else the Trainer's `seed`. The Trainer's sampler draws the data order
    (and so each worker's shard) from the same `data_seed`-else-`seed`, so one `--seed` changes every random
    choice of a run: initialization, held-out files, subsets, order and shards.

    Args:
        spec (`Mapping[str, Any]`, *optional*): the `data:` section.
        seed (`int`): `TrainingArguments.seed`.
        data_seed (`int`, *optional*): `TrainingArguments.data_seed`.

    Returns:
        `dict[str, Any]`: a copy of the section with `seed` set.
    """
    spec = dict(spec or {})
    if spec.get("seed") is None:
        spec["seed"] = seed if data_seed is None else data_seed
    return spec


def tokenize_and_group(
    dataset: Dataset | DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    num_proc: int | None = None,
    group_batch_size: int = 1000,
    text_column: str = "text",
) -> Dataset | DatasetDict:
    """
    Tokenize documents and pack them into fixed-length blocks for causal language modeling (as `run_clm.py` does).

    Every document is followed by the EOS token; the token stream of each batch of `group_batch_size` consecutive
    documents is cut into blocks of `block_size` tokens, and the remainder (fewer than `block_size` tokens per batch)
    is dropped.

    Args:
        dataset (`Dataset` or `DatasetDict`): documents in the column `text_column`.
        tokenizer (`PreTrainedTokenizerBase`): a tokenizer with an EOS token.
        block_size (`int`): tokens per block (no longer than the model's `max_position_embeddings`).
        num_proc (`int`, *optional*): worker processes for `datasets.map`.
        group_batch_size (`int`, *optional*, defaults to 1000): documents concatenated before cutting.
        text_column (`str`, *optional*, defaults to `"text"`): the column holding the text.

    Returns:
        `Dataset` or `DatasetDict` (same as `dataset`): columns `input_ids` and `labels` (a copy of `input_ids`; the
        model shifts them), each row `block_size` tokens long.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("The tokenizer has no EOS token, which separates documents when they are packed.")

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [doc + [eos_id] for doc in ids]}

    def group(batch: dict[str, list]) -> dict[str, list]:
        stream = list(chain.from_iterable(batch["input_ids"]))
        total = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, total, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    if isinstance(dataset, DatasetDict):
        return DatasetDict(
            {
                split: tokenize_and_group(part, tokenizer, block_size, num_proc, group_batch_size, text_column)
                for split, part in dataset.items()
            }
        )
    tokenized = dataset.map(
        tokenize, batched=True, num_proc=num_proc, remove_columns=dataset.column_names, desc="Tokenizing"
    )
    return tokenized.map(
        group,
        batched=True,
        batch_size=group_batch_size,
        num_proc=num_proc,
        desc=f"Packing into blocks of {block_size} tokens",
    )


def check_enough_blocks(num_blocks: int, num_shards: int, batch_size: int, split: str = "train") -> None:
    """
    Fail early when a split cannot give every data shard (process) one full batch.

    Args:
        num_blocks (`int`): number of packed blocks in the split.
        num_shards (`int`): number of data shards, usually the number of processes.
        batch_size (`int`): per-device batch size.
        split (`str`, *optional*, defaults to `"train"`): the split's name, for the message.

    Raises:
        `ValueError`: when `num_blocks < num_shards * batch_size`, saying how to fix it.
    """
    needed = num_shards * batch_size
    if num_blocks < needed:
        raise ValueError(
            f"The {split} split has {num_blocks} blocks, but {num_shards} data shard(s) x batch size {batch_size} "
            f"need at least {needed}. Use more data (raise `data.max_train_samples`/`max_eval_samples`, or point "
            "`data.path` at a larger corpus), a smaller `data.block_size`, a smaller per-device batch size, or "
            "fewer processes."
        )


def check_vocab(tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig) -> None:
    """
    Fail early when the tokenizer can produce ids that the model has no embedding for.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the tokenizer.
        model_config (`PretrainedConfig`): the model's config (its `vocab_size` is read).

    Raises:
        `ValueError`: when `len(tokenizer) > model_config.vocab_size`.
    """
    check_vocab_size(len(tokenizer), model_config.vocab_size)


def set_model_max_length(tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig) -> None:
    """
    Set `tokenizer.model_max_length` to the model's positions, so the saved tokenizer warns about (and truncates to)
    inputs the model cannot take, instead of keeping the library's "no limit" placeholder.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the tokenizer to update (call it after packing the training data,
            whose documents are longer than the model's positions before they are cut into blocks).
        model_config (`PretrainedConfig`): the model's config; left as it is when it states no positions.
    """
    positions = model_positions(model_config)
    if positions is not None:
        tokenizer.model_max_length = positions


def _read_files(files: Sequence[Path], max_files: int | None, seed: int) -> Dataset:
    """Read a seeded random pick of up to `max_files` non-blank files (all of them when `max_files` is None)."""
    order = list(files)
    if max_files is not None:
        random.Random(seed).shuffle(order)
    texts = []
    for path in order:
        if max_files is not None and len(texts) >= max_files:
            break
        # A few stdlib files are not UTF-8 (test data on purpose); the replacement character keeps them usable.
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            texts.append(text)
    return Dataset.from_dict({"text": texts})


def _load_stdlib(spec: Mapping[str, Any], eval_fraction: float, seed: int) -> DatasetDict:
    files = stdlib_corpus_files(include_tests=spec.get("include_tests", False))
    if not files:
        raise ValueError(f"No .py files found under {sysconfig.get_paths()['stdlib']!r}.")
    train_files, eval_files = split_files(files, eval_fraction, seed)
    return DatasetDict(
        train=_read_files(train_files, spec.get("max_train_samples"), seed),
        validation=_read_files(eval_files, spec.get("max_eval_samples"), seed),
    )


def _load_with_datasets(spec: Mapping[str, Any], eval_fraction: float, seed: int) -> DatasetDict:
    if not spec.get("path"):
        raise ValueError("data.source 'datasets' needs data.path (a dataset name, folder, or builder like 'json').")
    kwargs = {key: spec[key] for key in ("name", "data_files", "data_dir", "split") if spec.get(key) is not None}
    source = ", ".join(f"data.{key}={value!r}" for key, value in {"path": spec["path"], **kwargs}.items())
    if spec["path"] in _TEXT_BUILDERS:
        for path in _local_data_files(spec.get("data_files")):
            _check_text_file(path, spec["path"])
    try:
        loaded = load_dataset(spec["path"], **kwargs)
    except (DatasetGenerationError, StopIteration) as error:
        cause = error.__cause__ or error.__context__ or error
        raise ValueError(
            f"Could not read the corpus ({source}): {type(cause).__name__}: {str(cause)[:300]}. Check that every data "
            "file is non-empty UTF-8 text in the builder's format (one document per line for 'text', one JSON object "
            "per line for 'json')."
        ) from error
    validation_split = spec.get("validation_split", "validation")
    if isinstance(loaded, Dataset):
        loaded = DatasetDict(train=loaded)
    if "train" not in loaded:
        raise ValueError(f"The dataset {spec['path']!r} has no 'train' split (splits: {list(loaded)}).")
    text_column = spec.get("text_column", "text")
    for split in ("train", validation_split):
        if split in loaded:
            _check_text_column(loaded[split], split, text_column, source)
    if validation_split in loaded:
        raw = DatasetDict(train=loaded["train"], validation=loaded[validation_split])
    else:
        if not 0 < eval_fraction < 1 or len(loaded["train"]) < 2:
            raise ValueError(
                f"The dataset has no {validation_split!r} split; set data.validation_split_percentage in (0, 100) "
                "on a train split of at least 2 rows to hold some out."
            )
        held_out = loaded["train"].train_test_split(test_size=eval_fraction, seed=seed)
        raw = DatasetDict(train=held_out["train"], validation=held_out["test"])
    return DatasetDict({split: _only_text(dataset, text_column) for split, dataset in raw.items()})


def _local_data_files(data_files: Any) -> list[Path]:
    """The local files that `data_files` (a path, a glob, a list or a split -> paths mapping) names."""
    if data_files is None:
        return []
    if isinstance(data_files, Mapping):
        return [path for value in data_files.values() for path in _local_data_files(value)]
    if isinstance(data_files, (list, tuple)):
        return [path for value in data_files for path in _local_data_files(value)]
    return [Path(name) for name in sorted(glob.glob(os.path.expanduser(str(data_files)))) if os.path.isfile(name)]


def _check_text_file(path: Path, builder: str) -> None:
    """Refuse an empty or binary (not UTF-8) data file before `datasets` fails on it without naming it."""
    if path.suffix.lower() in _COMPRESSED_SUFFIXES:
        return
    with open(path, "rb") as handle:
        head = handle.read(_SNIFFED_BYTES)
    if not head.strip():
        raise ValueError(
            f"The data file {path} is empty (data.data_files). Point data.data_files at files that hold text, or "
            "leave this one out."
        )
    problem = _binary_content(head)
    if problem:
        raise ValueError(
            f"The data file {path} is not UTF-8 text ({problem}); it looks binary. The {builder!r} builder reads "
            "UTF-8 text: point data.data_files at text files, or convert this one to UTF-8 (for example with "
            "`iconv -t utf-8`)."
        )


def _binary_content(head: bytes) -> str | None:
    """What makes the start of a file not UTF-8 text, or `None`."""
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at byte {nul}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as error:
        return f"byte {error.start}: {error.reason}"
    return None


def _check_text_column(dataset: Dataset, split: str, text_column: str, source: str) -> None:
    """The text column exists, holds strings, and has no null rows (which would crash tokenization much later)."""
    if text_column not in dataset.column_names:
        raise ValueError(
            f"The {split} split has no column {text_column!r} (columns: {dataset.column_names}); set data.text_column."
        )
    column = dataset.with_format("arrow")[text_column]
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_null(column.type)):
        raise ValueError(
            f"Column {text_column!r} of the {split} split ({source}) holds {column.type}, not text; set "
            "data.text_column to the column that holds the documents."
        )
    if column.null_count:
        first = pc.index(pc.is_null(column), True).as_py()
        raise ValueError(
            f"{column.null_count} of {len(column)} rows of the {split} split ({source}) have no text (null in column "
            f"{text_column!r}); the first is row {first}. Remove or fill those rows in the data files (or filter them "
            "out before training) and rerun."
        )


def _only_text(dataset: Dataset, text_column: str) -> Dataset:
    dataset = dataset.select_columns([text_column])
    if text_column != "text":
        dataset = dataset.rename_column(text_column, "text")
    return dataset


def _subset(dataset: Dataset, max_samples: int | None, seed: int) -> Dataset:
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    return dataset.shuffle(seed=seed).select(range(max_samples))


def load_or_train_tokenizer(
    folder: str | os.PathLike, spec: Mapping[str, Any] | None, texts: Iterable[str], retrain_provisional: bool = True
) -> PreTrainedTokenizerBase:
    """
    The run's tokenizer, fixed once its run has started training: trained (`build_tokenizer`) and saved to `folder`
    as provisional, kept for good by `keep_run_tokenizer` when training starts, then loaded from there at every
    later start (a resume, a restart, another worker on the shared disk), never retrained or overwritten, so token
    ids keep their meaning when the data changes. A provisional tokenizer (its start stopped before training, e.g.
    on a refused corpus) is trained again from the texts and section of this start, so a corrected re-run never
    inherits the failed start's tokenizer.

    Args:
        folder (`str` or `os.PathLike`): where the run keeps its tokenizer (e.g. `output_dir/tokenizer`).
        spec (`Mapping[str, Any]`, *optional*): the `tokenizer:` section (see `build_tokenizer`). With `path`, that
            tokenizer is loaded from where it is and `folder` is not used.
        texts (`Iterable[str]`): the training documents, read only when the tokenizer is trained.
        retrain_provisional (`bool`, *optional*, defaults to `True`): train a provisional tokenizer again. Only the
            process that trains first (rank 0) may: the others of the same start load what it wrote.

    Returns:
        `PreTrainedTokenizerBase`: the tokenizer.

    Raises:
        `ValueError`: when `folder` holds a kept tokenizer trained with another `tokenizer:` section, or files that
            no longer match the tokenizer that was trained there (the message says what to do).
    """
    spec = dict(spec or {})
    check_known_keys(spec, sorted(TOKENIZER_SPEC_KEYS), "the tokenizer: section")
    if spec.get("path"):
        return build_tokenizer(spec, texts)
    folder = Path(folder)
    replaced = None
    if folder.exists():
        record = _tokenizer_record(folder)
        if not (retrain_provisional and (record or {}).get("provisional")):
            return _load_fixed_tokenizer(folder, spec)
        logger.warning(
            "%s holds a tokenizer from a start that stopped before training; training this run's tokenizer again "
            "from this start's data and tokenizer: section.",
            folder,
        )
        replaced = folder.with_name(f".{folder.name}.replaced-{os.getpid()}")
        os.rename(folder, replaced)
    tokenizer = build_tokenizer(spec, texts)
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    tokenizer.save_pretrained(staging)
    record = {"tokenizer_section": spec, "fingerprint": tokenizer_fingerprint(tokenizer), "provisional": True}
    (staging / TOKENIZER_RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True))
    try:
        os.rename(staging, folder)
    except OSError:
        # Another process published the tokenizer first: use that one.
        shutil.rmtree(staging, ignore_errors=True)
        return _load_fixed_tokenizer(folder, spec)
    finally:
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    return tokenizer


def keep_run_tokenizer(folder: str | os.PathLike) -> None:
    """Mark the provisional tokenizer `load_or_train_tokenizer` trained in `folder` as the run's for good (call it
    when training starts, on the process that trained it); nothing when it is kept already or `folder` holds none."""
    folder = Path(folder)
    record = _tokenizer_record(folder)
    if not (record or {}).get("provisional"):
        return
    record.pop("provisional")
    staging = folder / f".{TOKENIZER_RECORD_NAME}.tmp-{os.getpid()}"
    staging.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(staging, folder / TOKENIZER_RECORD_NAME)


def _tokenizer_record(folder: Path) -> dict | None:
    path = folder / TOKENIZER_RECORD_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of everything that maps text to ids (vocabulary, merges, normalisation, special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    mapping = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256(f"{mapping}\n{special}".encode()).hexdigest()[:16]


def dataset_fingerprint(dataset: Dataset, samples: int = 64, column: str = "input_ids") -> str:
    """A short hash of a packed dataset's length and `samples` evenly spaced rows: equal on workers that built the
    same blocks, different (with near certainty) when their data, tokenizer or packing differ."""
    length = len(dataset)
    rows = sorted({i * (length - 1) // max(samples - 1, 1) for i in range(samples)}) if length else []
    picked = dataset.select(rows)[column] if rows else []
    return hashlib.sha256(json.dumps([length, list(picked)]).encode()).hexdigest()[:16]


def _load_fixed_tokenizer(folder: Path, spec: Mapping[str, Any]) -> PreTrainedTokenizerBase:
    record_path = folder / TOKENIZER_RECORD_NAME
    if not record_path.is_file():
        raise ValueError(
            f"{folder} exists but holds no tokenizer trained by this run ({TOKENIZER_RECORD_NAME} is missing). To use "
            f"a tokenizer you made, set `tokenizer: path: {folder}`; otherwise delete or move that folder (the run "
            "then trains its tokenizer there) or use another --output_dir."
        )
    record = json.loads(record_path.read_text())
    if record["tokenizer_section"] != dict(spec):
        raise ValueError(
            f"This run's tokenizer in {folder} was trained with `tokenizer:` {record['tokenizer_section']}, but the "
            f"config now says {dict(spec)}. A run's tokenizer is fixed at its first start (retraining it would change "
            "what every token id means to the checkpoints). Put the old `tokenizer:` section back, or train a new "
            "model in another --output_dir."
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer_fingerprint(tokenizer) != record["fingerprint"]:
        raise ValueError(
            f"The tokenizer files in {folder} changed after this run trained them (fingerprint "
            f"{tokenizer_fingerprint(tokenizer)}, trained {record['fingerprint']}): restore them from a checkpoint "
            "folder of this run (each holds a copy), or train a new model in another --output_dir."
        )
    return tokenizer
