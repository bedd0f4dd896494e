"""The served model: its configuration (``config``), weights, tokenizer, the decoder
(Llama, Qwen2, Qwen3 families) and the paged KV cache it reads and writes."""

from gpu.model.batch import PackedBatch
from gpu.model.decoder import Decoder

__all__ = ["Decoder", "PackedBatch"]
