"""Serving dtypes: which dtype a model runs in on which device (``--dtype``).

``auto`` (or None) serves the checkpoint's declared dtype (``config.json`` ``dtype`` /
``torch_dtype``) where the device runs it, else the device's default: float32 on the
CPU, bfloat16 on CUDA. The CPU runs float32, bfloat16 and float16 (torch's CPU kernels
cover every operation the decoder uses); CUDA runs bfloat16 and float16. A requested
dtype the device does not run is refused with a message naming ``--dtype``.
"""

from __future__ import annotations

import torch

_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16"}
_DEVICE_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                  "cuda": (torch.bfloat16, torch.float16)}
_DEVICE_DEFAULT = {"cpu": torch.float32, "cuda": torch.bfloat16}


def _named(name: str) -> torch.dtype | None:
    return _BY_NAME.get(_ALIASES.get(name, name))


def resolve_dtype(device: str, dtype: torch.dtype | str | None,
                  checkpoint_dtype: str | None = None) -> torch.dtype:
    """The dtype to serve on ``device``: ``dtype`` if given (a name or a torch dtype),
    else (``None``/``"auto"``) the checkpoint's where the device runs it, else the
    device's default."""
    kind = torch.device(device).type
    supported = _DEVICE_DTYPES.get(kind, (torch.float32,))
    if dtype is None or dtype == "auto":
        declared = _named(checkpoint_dtype) if checkpoint_dtype else None
        if declared in supported:
            return declared
        return _DEVICE_DEFAULT.get(kind, torch.float32)
    chosen = _named(dtype) if isinstance(dtype, str) else dtype
    if chosen is None:
        raise ValueError(f"--dtype {dtype!r}: choose auto, {', '.join(_BY_NAME)}")
    if chosen not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(f"--dtype {str(chosen).removeprefix('torch.')} is not supported on "
                         f"the {kind} backend; it runs {names} (or --dtype auto)")
    return chosen
