"""The exit codes of the `upd` commands, declared once (README, docs/verify.md and `upd --help` state them).

The verify report (replay/engine.py) and the command line share them; they live apart from both so that a command
that only reads a run (`upd info`) imports neither the replay engine nor torch.
"""
EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE, EXIT_NOTHING_VERIFIABLE, EXIT_RULE_FAILED = 0, 1, 2, 3, 4
# Interrupted (Ctrl-C, SIGINT): 128 + SIGINT's number, as shells report it, so that a script tells an interrupted
# verify from a mismatch (1).
EXIT_INTERRUPTED = 130
