"""Generation: the vLLM-backed samplers and in-place weight sync used by the policy actor.

``VllmEngine`` makes one batched ``LLM.generate`` call per batch (the default, faster on CPU);
``AsyncVllmEngine`` feeds vLLM's ``AsyncLLM`` one request per prompt, concurrently. Importing
this package does not import vLLM; ``create`` does, after setting the environment vLLM reads
at import.
"""

from forge.generation.async_engine import AsyncVllmEngine
from forge.generation.vllm_engine import VllmEngine, configure_vllm_env
from forge.generation.weight_sync import WeightSyncExtension, checkpoint_spec, validate_state_dict

__all__ = [
    "AsyncVllmEngine",
    "VllmEngine",
    "WeightSyncExtension",
    "checkpoint_spec",
    "configure_vllm_env",
    "validate_state_dict",
]
