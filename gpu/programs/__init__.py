"""Prepared programs: packed step programs (prefill, scored prefill, decode, mixed) and
state operations, all binding views of one shared workspace."""

from gpu.programs.state_ops import StateOpProgram
from gpu.programs.step import StepProgram
from gpu.programs.workspace import Workspace

__all__ = ["StateOpProgram", "StepProgram", "Workspace"]
