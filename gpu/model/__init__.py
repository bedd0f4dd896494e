"""The served model: its configuration (``config``), weights, tokenizer, the decoder
(Llama, Qwen2, Qwen3 families) and the paged KV cache it reads and writes."""

from gpu.model.decoder import Decoder, PackedBatch

__all__ = ["Decoder", "PackedBatch"]
