"""Generation: the vLLM-backed sampler and in-place weight sync used by the policy actor.

Importing this package does not import vLLM; ``VllmEngine.create`` does, after setting the
environment vLLM reads at import.
"""

from forge.generation.vllm_engine import VllmEngine, configure_vllm_env
from forge.generation.weight_sync import WeightSyncExtension, checkpoint_spec, validate_state_dict

__all__ = [
    "VllmEngine",
    "WeightSyncExtension",
    "checkpoint_spec",
    "configure_vllm_env",
    "validate_state_dict",
]
