"""The configs shipped with hf_diloco (`hf-diloco configs` lists them; `--config NAME` reads one).

This folder is installed as the package `hf_diloco.configs` (pyproject.toml's `package-dir`), so the wheel and an
editable checkout read the same files; this file only makes it a package for `importlib.resources`."""
