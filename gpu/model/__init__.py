"""The served model: its configuration (``config``), weights, tokenizer, the decoder
(Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2 families) and the paged KV cache it reads and writes.

Importing this package loads no torch: the configuration and the tokenizer are
re-exported by the ``gpu`` face; the decoder and the cache are imported from their
modules inside ``gpu``."""
