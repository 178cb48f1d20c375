"""Adafactor, Muon and SparseAdam: every option, every CPU implementation.

Adafactor offers the for-loop and foreach implementations; Muon and SparseAdam only a for-loop (torch rejects
foreach/fused/capturable/differentiable for them, and for Adafactor all but foreach).
"""
import pytest
import torch

from . import Case

ADAFACTOR_IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}}

ADAFACTOR_OPTIONS = {
    "plain": dict(lr=1e-2),
    "wd-maximize": dict(lr=1e-2, weight_decay=0.1, maximize=True),
    # eps1 large enough that its clamps act, eps2 above the parameters' RMS, d and beta2_decay changed
    "beta2decay-d-eps": dict(lr=2e-2, beta2_decay=-0.5, d=1.2, eps=(1e-2, 0.5)),
    "eps1-small-clip": dict(lr=1e-2, eps=(1e-30, 1e-3), d=1.0, beta2_decay=-0.3),
    "tensor-lr-wd": dict(lr=torch.tensor(1e-2), weight_decay=0.05),
}

MUON_OPTIONS = {
    "default": dict(lr=0.02),  # nesterov, momentum 0.95, weight_decay 0.1, 5 steps, default coefficients
    "nesterov-off-original": dict(lr=0.02, nesterov=False, momentum=0.9, weight_decay=0.05,
                                  adjust_lr_fn="original"),
    "match-rms-adamw-ns": dict(lr=0.02, adjust_lr_fn="match_rms_adamw", ns_steps=3,
                               ns_coefficients=(3.0, -3.2, 1.2), eps=1e-5, weight_decay=0.0),
    "no-momentum-tensor-lr": dict(lr=torch.tensor(0.02), momentum=0.0, weight_decay=0.2, ns_steps=7),
}

SPARSEADAM_OPTIONS = {
    "plain": dict(lr=1e-2),
    "betas-eps-maximize": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True),
    "tensor-lr-betas": dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.85), torch.tensor(0.995))),
}


def _perturb(options, default_weight_decay=0.0):
    wd = options.get("weight_decay", default_weight_decay)
    return ("update", "lr") + (("weight_decay",) if wd else ())


def muon_groups(groups):
    """Muon takes 2-D parameters only: keep the 2-D weights, split into two groups when there are several."""
    weights = [p for g in groups for p in g["params"] if p.ndim == 2]
    return [{"params": weights[:1]}, {"params": weights[1:]}] if len(weights) > 1 else [{"params": weights}]


def _adafactor(opt_id, options, impl="forloop", **case):
    kwargs = dict(options, **ADAFACTOR_IMPLS[impl])
    return Case(f"adafactor-{opt_id}-{impl}" + (f"-{case['model']}" if "model" in case else ""),
                lambda groups, kw=kwargs: torch.optim.Adafactor(groups, **kw), perturb=_perturb(options), impl=impl, **case)


def _muon(opt_id, options, **case):
    return Case(f"muon-{opt_id}" + (f"-{case['model']}" if "model" in case else ""),
                lambda groups, kw=options: torch.optim.Muon(muon_groups(groups), **kw),
                perturb=_perturb(options, default_weight_decay=0.1),
                marks=[pytest.mark.slow], **case)  # a Muon verify takes 1-2 s: whole-tensor Newton-Schulz in float64


def _sparseadam(opt_id, options):
    return Case(f"sparseadam-{opt_id}", lambda groups, kw=options: torch.optim.SparseAdam(groups, **kw),
                sparse=True, perturb=_perturb(options))


CASES = (
    [_adafactor(o, opts, impl) for o, opts in ADAFACTOR_OPTIONS.items() for impl in ADAFACTOR_IMPLS]
    + [_adafactor("wd-maximize", ADAFACTOR_OPTIONS["wd-maximize"], "forloop", model="conv"),
       _adafactor("beta2decay-d-eps", ADAFACTOR_OPTIONS["beta2decay-d-eps"], "foreach", model="conv"),
       _adafactor("tensor-lr-wd", ADAFACTOR_OPTIONS["tensor-lr-wd"], "foreach", model="attention"),
       _adafactor("plain", ADAFACTOR_OPTIONS["plain"], "forloop", model="attention")]
    + [_muon(o, opts) for o, opts in MUON_OPTIONS.items()]
    + [_muon("default", MUON_OPTIONS["default"], model="conv"),
       _muon("match-rms-adamw-ns", MUON_OPTIONS["match-rms-adamw-ns"], model="attention"),
       _muon("nesterov-off-original", MUON_OPTIONS["nesterov-off-original"], model="attention")]
    + [_sparseadam(o, opts) for o, opts in SPARSEADAM_OPTIONS.items()]
)
