"""The pipelined trainer (`pipeline_stages` > 1); defined in `hf_diloco.integrations.trainer.pipeline_stages`."""

from .integrations.trainer.pipeline_stages import PipelineTrainerMixin, SafetensorsFolder

__all__ = ["PipelineTrainerMixin", "SafetensorsFolder"]
