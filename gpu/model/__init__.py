"""The served model: its configuration (``config``), weights, tokenizer, the decoder
(Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 families), the LLaVA vision tower and its
image preprocessing (``vision*``, ``image_processor``) and the paged KV cache the decoder
reads and writes.

Importing this package loads no torch: the configuration and the tokenizer are
re-exported by the ``gpu`` face; the decoder and the cache are imported from their
modules inside ``gpu``."""
