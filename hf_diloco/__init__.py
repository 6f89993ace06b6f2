"""hf_diloco: DiLoCo, Streaming DiLoCo and DiLoCoX for Hugging Face causal LMs over slow links."""

from .core.settings.config import DiLoCoConfig

__all__ = [
    "DiLoCoConfig",
    "DiLoCo",
    "Topology",
    "worker_mesh",
    "DiLoCoTrainer",
    "DiLoCoTrainingArguments",
    "DiLoCoPlugin",
    "TorchftMembership",
    "open_store",
    "MinWorkersTimeout",
    "write_model_card",
    "push_folder_to_hub",
    "init_process_group_for_restart",
]

_LAZY = {
    "DiLoCo": ("core.diloco", "DiLoCo"),
    "Topology": ("core.layout.topology", "Topology"),
    "DiLoCoTrainer": ("integrations.trainer", "DiLoCoTrainer"),
    "DiLoCoTrainingArguments": ("integrations.trainer", "DiLoCoTrainingArguments"),
    "DiLoCoPlugin": ("integrations.accelerate_plugin", "DiLoCoPlugin"),
    "worker_mesh": ("parallel.fsdp", "worker_mesh"),
    "TorchftMembership": ("backends.torchft_membership", "TorchftMembership"),
    "open_store": ("backends.object_store", "open_store"),
    "MinWorkersTimeout": ("core.membership.elastic", "MinWorkersTimeout"),
    "write_model_card": ("publish.model_card", "write_model_card"),
    "push_folder_to_hub": ("publish.hub", "push_folder_to_hub"),
    "init_process_group_for_restart": ("integrations.launch", "init_process_group_for_restart"),
}


def __getattr__(name: str):
    # transformers/accelerate glue (and the model-parallel helpers) are imported on first use, so that `hf_diloco.core`
    # stays importable without them and importing the package stays quick.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
