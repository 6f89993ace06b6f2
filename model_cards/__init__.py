"""The model card template every saved hf_diloco model folder gets as its `README.md`.

This folder is installed as the package `hf_diloco.model_cards` (pyproject.toml's `package-dir`), so the wheel and
an editable checkout read the same file; this file only makes it a package for `importlib.resources`."""
