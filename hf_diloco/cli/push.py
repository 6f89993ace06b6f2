"""`hf-diloco push FOLDER REPO_ID`: upload what a user publishes from a saved model folder to the Hugging Face Hub.

Uploaded: weights, configs, tokenizer files, custom model code, the model card (its usage snippet pointing at
REPO_ID) and the results files it quotes; TensorBoard logs with `--include_logs`. Checkpoints, optimizer, scheduler,
RNG and DiLoCo state and `training_args.bin` stay local unless named with `--include`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..publish.hub import files_to_publish, push_folder_to_hub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-diloco push",
        description="Upload what a user publishes from a saved model folder to the Hugging Face Hub: weights, "
        "configs, tokenizer, the model card (pointing at REPO_ID) and its results files; no checkpoints, optimizer, "
        "RNG or DiLoCo state unless --include names them.",
    )
    parser.add_argument("folder", help="a saved model folder, e.g. the output_dir of hf-diloco pretrain")
    parser.add_argument("repo_id", help="namespace/name of the Hub model repository (created if needed)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", default=None, help="a Hub token (default: the one saved by `hf auth login`)")
    parser.add_argument("--endpoint", default=None, help="the Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--revision", default=None, help="the branch to commit to (default: main)")
    parser.add_argument("--commit_message", default="Upload DiLoCo-trained model", help="message of the commit")
    parser.add_argument("--include_logs", action="store_true", help="also upload the TensorBoard logs under runs/")
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="also upload the files matching this glob (relative to FOLDER), e.g. 'checkpoint-*/*'; repeatable",
    )
    parser.add_argument("--dry_run", action="store_true", help="list the files that would be uploaded and stop")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = files_to_publish(args.folder, include_logs=args.include_logs, include=args.include)
    print(f"{len(files)} file(s) of {args.folder} to upload: {', '.join(files) or 'none'}")
    if args.dry_run:
        return 0
    info = push_folder_to_hub(
        args.folder,
        args.repo_id,
        token=args.token,
        endpoint=args.endpoint,
        private=args.private,
        commit_message=args.commit_message,
        include_logs=args.include_logs,
        include=args.include,
        revision=args.revision,
    )
    print(f"pushed to {info.commit_url}", file=sys.stdout)
    return 0
