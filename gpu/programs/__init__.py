"""Prepared programs: packed step programs (prefill, scored prefill, decode, mixed),
state operations and the complete speculative programs, all binding views of one
shared workspace. Import the modules themselves; this package imports nothing, so
the host-only frames (``speculative_frames``) load no torch."""
