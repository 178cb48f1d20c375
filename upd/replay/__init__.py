"""Replay rules: one small module per optimizer family, registered by optimizer class.

Add your own with ``upd.replay.register(MyOptimizer)``; see docs/verify.md.
"""
from .registry import NotReplayable, Replayed, ReplayRule, lookup, register, registered, unregister
from . import adam, sgd  # noqa: F401  (registers the built-in rules)

__all__ = ["register", "unregister", "lookup", "registered", "Replayed", "ReplayRule", "NotReplayable"]
