"""flare's scheduler: pure, synchronous decisions over prepared graphs.

This package never imports trio, torch, or any clock; time enters through
``Scheduler.advance_to(now_ns)``. See ``docs/architecture.md``.
"""
