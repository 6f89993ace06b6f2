"""Push a saved hf_diloco model folder (global weights + model card) to the Hugging Face Hub.

Only what a user publishes is uploaded (`files_to_publish`): weights, configs, tokenizer files, custom model code,
the card and the results files it quotes; TensorBoard logs (`runs/`) when asked. Checkpoints, optimizer, scheduler,
grad scaler, RNG and DiLoCo state, `training_args.bin` and `trainer_state.json` stay local unless named in `include`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, constants

from .model_card import DILOCO_TAG, has_diloco_tag, point_card_at_repo, write_model_card

CARD_NAME = "README.md"
LOGS_FOLDER = "runs"
# Top-level files of a saved model folder that a user publishes; everything else needs `include`.
PUBLISHED_PATTERNS = (
    CARD_NAME,
    "*config.json",  # config.json, generation_config.json, tokenizer_config.json, adapter_config.json
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "adapter_model.bin",
    "tokenizer.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "spiece.model",
    "chat_template.*",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
    "all_results.json",
    "eval_results.json",
    "train_results.json",
)


def files_to_publish(folder: str | Path, include_logs: bool = False, include: Sequence[str] = ()) -> list[str]:
    """
    The files of a saved model folder that a push uploads, as paths relative to `folder`, sorted.

    Args:
        folder (`str` or `Path`): the saved model folder.
        include_logs (`bool`, *optional*, defaults to `False`): also upload the TensorBoard logs under `runs/`.
        include (`Sequence[str]`, *optional*): extra glob patterns of relative paths to upload as well, e.g.
            `["training_args.bin", "checkpoint-*/*"]`.

    Returns:
        `list[str]`: the relative paths (POSIX separators).
    """
    folder = Path(folder)
    chosen = set()
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        relative = path.relative_to(folder).as_posix()
        top_level = "/" not in relative
        if (
            (top_level and any(fnmatch.fnmatch(relative, pattern) for pattern in PUBLISHED_PATTERNS))
            or (include_logs and relative.startswith(f"{LOGS_FOLDER}/"))
            or any(fnmatch.fnmatch(relative, pattern) for pattern in include)
        ):
            chosen.add(relative)
    return sorted(chosen)


def ensure_model_card(folder: str | Path, model_card: Mapping[str, Any] | None = None) -> Path:
    """
    Make sure `folder/README.md` is a model card with the `diloco` tag.

    Args:
        folder (`str` or `Path`): the saved model folder.
        model_card (`Mapping[str, Any]`, *optional*):
            arguments of [`~hf_diloco.publish.model_card.render_model_card`]; when given, the card is (re)written
            from them.

    Returns:
        `Path`: the card's path.

    Raises:
        `ValueError`: the folder has no `README.md` and no `model_card` arguments were given.
    """
    folder = Path(folder)
    readme = folder / CARD_NAME
    if model_card is not None:
        return write_model_card(folder, **model_card)
    if not readme.is_file():
        raise ValueError(
            f"{folder} has no README.md model card; write one with hf_diloco.write_model_card(folder, ...) "
            "or pass model_card=dict(settings=..., communication=..., data_description=..., ...)."
        )
    if not has_diloco_tag(readme):
        # A card written by other tooling is kept as it is; only the tag that marks DiLoCo training is added.
        card = ModelCard.load(readme, ignore_metadata_errors=True)
        card.data.tags = [*(card.data.tags or []), DILOCO_TAG]
        card.save(readme)
    return readme


def push_folder_to_hub(
    folder: str | Path,
    repo_id: str,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    commit_message: str = "Upload DiLoCo-trained model",
    model_card: Mapping[str, Any] | None = None,
    include_logs: bool = False,
    include: Sequence[str] = (),
    revision: str | None = None,
    run_as_future: bool = False,
    api: HfApi | None = None,
    create_repo: bool = True,
) -> CommitInfo:
    """
    Create `repo_id` if needed and upload what a user publishes from `folder` ([`files_to_publish`]), with the model
    card's usage snippet pointing at `repo_id` (the card in `folder` is left as it is).

    Args:
        folder (`str` or `Path`): a saved model folder (e.g. from `save_pretrained`, holding the global weights).
        repo_id (`str`): `namespace/name` on the Hub.
        token (`str`, *optional*): a Hub token; defaults to the locally saved one.
        endpoint (`str`, *optional*): the Hub endpoint; defaults to `HF_ENDPOINT` / huggingface.co.
        private (`bool`, *optional*, defaults to `False`): create the repository as private.
        commit_message (`str`, *optional*): message of the upload commit.
        model_card (`Mapping[str, Any]`, *optional*): arguments of `render_model_card`, see [`ensure_model_card`].
        include_logs (`bool`, *optional*, defaults to `False`): also upload the TensorBoard logs under `runs/`.
        include (`Sequence[str]`, *optional*): extra glob patterns of relative paths to upload.
        revision (`str`, *optional*): the branch to commit to.
        run_as_future (`bool`, *optional*, defaults to `False`): return a `Future` instead of waiting.
        api (`HfApi`, *optional*): the client to use (e.g. the Trainer's); `endpoint` and `token` build one otherwise.
        create_repo (`bool`, *optional*, defaults to `True`): create the repository first when it does not exist.

    Returns:
        `CommitInfo`: the upload commit (a `Future` of it with `run_as_future=True`).

    Raises:
        `ValueError`: `folder` is not a directory, or has no card and `model_card` is not given; Hugging Face's
            offline mode is on (`HF_HUB_OFFLINE`), before anything is written or sent.
    """
    folder = Path(folder)
    refuse_offline_push(f"{folder}", repo_id)
    if not folder.is_dir():
        raise ValueError(f"folder {folder} does not exist or is not a directory.")
    ensure_model_card(folder, model_card)
    api = api or HfApi(endpoint=endpoint, token=token)
    if create_repo:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model", token=token)
    return api.create_commit(
        repo_id=repo_id,
        repo_type="model",
        operations=publish_operations(folder, repo_id, include_logs=include_logs, include=include),
        commit_message=commit_message,
        revision=revision,
        run_as_future=run_as_future,
        token=token,
    )


def refuse_offline_push(what: str, repo_id: str) -> None:
    """Raise `ValueError` when Hugging Face's offline mode is on (`HF_HUB_OFFLINE=1`, or `TRANSFORMERS_OFFLINE=1`):
    huggingface_hub would refuse every request of the push, after the repository's card had been written."""
    if constants.is_offline_mode():
        raise ValueError(
            f"HF_HUB_OFFLINE is set: pushing {what} to {repo_id} needs the network. Unset HF_HUB_OFFLINE (and "
            "TRANSFORMERS_OFFLINE) for this command, on a machine that reaches the Hub; nothing was written or sent."
        )


def publish_operations(
    folder: str | Path, repo_id: str, include_logs: bool = False, include: Sequence[str] = ()
) -> list[CommitOperationAdd]:
    """One upload per file of [`files_to_publish`]; a DiLoCo card is uploaded pointing at `repo_id`."""
    folder = Path(folder)
    operations = []
    for relative in files_to_publish(folder, include_logs=include_logs, include=include):
        content: str | bytes = str(folder / relative)
        if relative == CARD_NAME and has_diloco_tag(folder / CARD_NAME):
            content = point_card_at_repo((folder / CARD_NAME).read_text(encoding="utf-8"), repo_id).encode()
        operations.append(CommitOperationAdd(path_in_repo=relative, path_or_fileobj=content))
    return operations
