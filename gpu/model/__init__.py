"""The decoder (Llama, Qwen2, Qwen3 families) over a paged KV cache."""

from gpu.model.decoder import Decoder, PackedBatch

__all__ = ["Decoder", "PackedBatch"]
