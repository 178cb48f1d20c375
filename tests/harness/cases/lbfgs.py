"""LBFGS: recorded, and reported as not verifiable (exit 3) with its reason, never as a pass or a fail."""
import torch

from . import Case

CASES = [
    Case("lbfgs-default", lambda g: torch.optim.LBFGS([p for grp in g for p in grp["params"]], lr=0.5, max_iter=4),
         closure=True, two_groups=False, perturb=(), expect_exit=3),
    Case("lbfgs-strong-wolfe", lambda g: torch.optim.LBFGS([p for grp in g for p in grp["params"]], lr=1,
                                                           max_iter=3, line_search_fn="strong_wolfe"),
         closure=True, two_groups=False, perturb=(), expect_exit=3, model="conv"),
]
