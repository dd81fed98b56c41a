"""Public types shared by the runners, the stores and the client."""

from .types import Command, InputError, Op, OutputEvent, SowCommand, SowRecord

__all__ = ["Command", "InputError", "Op", "OutputEvent", "SowCommand", "SowRecord"]
