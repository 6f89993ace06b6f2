"""Model parallelism inside one worker: pipeline stages of any causal LM with a block stack, and FSDP2 over the
worker's data-parallel ranks (pure torch).

What happens inside a worker is not DiLoCo: the engine (`hf_diloco.core`) only sees the parameters a rank holds.
"""

from .fsdp import worker_mesh
from .pipeline import PipelineMismatchError, PipelineRunner, PipelineStageModule, build_stages, plan_pipeline

__all__ = [
    "PipelineMismatchError",
    "PipelineRunner",
    "PipelineStageModule",
    "build_stages",
    "plan_pipeline",
    "worker_mesh",
]
