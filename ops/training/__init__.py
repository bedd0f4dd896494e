"""Pieces of the embedded default model's training recipe (``flare train-default``).

``corpus`` picks the training text, ``special_tokens`` fixes the chat format, ``tokenizer``
trains the byte-level BPE, ``llama`` is the plain-torch model whose parameter names match
transformers' ``LlamaForCausalLM``, ``trainer`` runs the time-bounded loop and ``export`` writes
HF-format checkpoint directories. Only ``ops/train_default.py`` and tests import this package.
"""
