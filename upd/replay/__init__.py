"""Verification: replay each recorded step with the optimizer's own math and compare with the record.

- ``engine``: reads a run, replays every (step, parameter) and compares (``upd.verify``);
- ``blocks``: a parameter's history read and replayed in bounded blocks and cache-sized chunks;
- ``parallel``: parameters spread over worker processes (``verify(..., jobs=N)``);
- ``explain``: says why a mismatching step mismatches, by replaying the usual suspects;
- ``registry``: replay rules keyed by optimizer class, and the adapter that hands a rule its state, step counter
  and hyperparameters, so that a rule is only the optimizer's math;
- ``capturable``: step-dependent scalars as torch's capturable code paths compute them;
- ``rules/``: one small module per optimizer family, each registering its rule on import.

Add a rule for your own optimizer with ``upd.replay.register(MyOptimizer)`` (see docs/verify.md).
"""
from .registry import (NotReplayable, Replayed, ReplayRule, ReplayRuleError, kept_when, load_plugins, lookup,
                       register, registered, unregister, zeros)
from . import rules  # noqa: F401,E402  (registers the torch.optim rules)

__all__ = ["register", "unregister", "lookup", "registered", "load_plugins", "Replayed", "ReplayRule",
           "NotReplayable", "ReplayRuleError", "zeros", "kept_when"]
