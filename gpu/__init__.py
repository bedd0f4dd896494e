"""flare's model and prepared programs.

Owns weight loading, the decoder, the paged KV cache and device-resident request
state, sampling, the catalog of prepared shapes, and the backends (``cpu``, ``cuda``)
that launch programs and time them. Imports ``policy`` for descriptor types only.
"""
