"""Push a saved hf_diloco model folder (global weights + model card) to the Hugging Face Hub."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, HfApi, ModelCard

from .model_card import DILOCO_TAG, has_diloco_tag, write_model_card


def ensure_model_card(folder: str | Path, model_card: Mapping[str, Any] | None = None) -> Path:
    """
    Make sure `folder/README.md` is a model card with the `diloco` tag.

    Args:
        folder (`str` or `Path`): the saved model folder.
        model_card (`Mapping[str, Any]`, *optional*):
            arguments of [`~hf_diloco.model_card.render_model_card`]; when given, the card is (re)written from them.

    Returns:
        `Path`: the card's path.

    Raises:
        `ValueError`: the folder has no `README.md` and no `model_card` arguments were given.
    """
    folder = Path(folder)
    readme = folder / "README.md"
    if model_card is not None:
        return write_model_card(folder, **model_card)
    if not readme.is_file():
        raise ValueError(
            f"{folder} has no README.md model card; write one with hf_diloco.model_card.write_model_card(folder, ...) "
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
) -> CommitInfo:
    """
    Create `repo_id` if needed and upload `folder` to it, model card included.

    Args:
        folder (`str` or `Path`): a saved model folder (e.g. from `save_pretrained`, holding the global weights).
        repo_id (`str`): `namespace/name` on the Hub.
        token (`str`, *optional*): a Hub token; defaults to the locally saved one.
        endpoint (`str`, *optional*): the Hub endpoint; defaults to `HF_ENDPOINT` / huggingface.co.
        private (`bool`, *optional*, defaults to `False`): create the repository as private.
        commit_message (`str`, *optional*): message of the upload commit.
        model_card (`Mapping[str, Any]`, *optional*): arguments of `render_model_card`, see [`ensure_model_card`].

    Returns:
        `CommitInfo`: the upload commit.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"folder {folder} does not exist or is not a directory.")
    ensure_model_card(folder, model_card)
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model", commit_message=commit_message)
