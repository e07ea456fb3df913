"""What checkpoints the engine reads, and the error for one it cannot: shared by the resolver
(``spec``) and the format readers (``gguf``, ``hf``), which import nothing of each other."""
from __future__ import annotations

from engine.errors import EngineError

FORMATS = ("seeded", "gguf", "safetensors")
HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
REAL_DTYPES = ("float32", "bfloat16", "float16", "float64")


class CheckpointError(EngineError, ValueError):
    """A model name or checkpoint path that cannot be served; ``source`` names it. A ValueError
    too, so the CLI's and the config's existing catches report it as a bad flag."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"model {source!r}: {reason}")
        self.source = source
        self.reason = reason
