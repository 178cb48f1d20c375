"""Adamax, NAdam and RAdam: every option, every CPU implementation.

None of the three has a fused implementation. Besides foreach=False/True:

- differentiable=True (for-loop only) runs step() with grad mode on, where torch's in-place update of a leaf
  parameter that requires grad raises; torch's own tests step non-leaf clones instead. Here the parameters'
  requires_grad is switched off for the duration of step() (`_differentiable`), so torch's differentiable code path
  runs on the real parameters.
- capturable=True is refused on CPU by a device check (`_get_capturable_supported_devices`: cuda, xpu, hpu, ...).
  The "-capturable-*" cases widen that check to "cpu" for the duration of step() (`_cpu_capturable`) so that torch's
  capturable for-loop and foreach code (float32 tensor arithmetic on the step counter, bias corrections folded into
  the denominators) is recorded and replayed without a GPU.

RAdam is SGD-like while rho_t <= 5, i.e. for its first 5 steps with beta2 = 0.999 (RAdam's rho_t is about t):
its cases run 7 steps to cover the switch, and the "radam-warm-*" cases start recording after 5 unrecorded steps so
that the perturbed step (the third recorded one) is a rectified, Adam-like step.
"""
import sys
from unittest import mock

import torch

from . import Case

IMPLS = {
    "forloop": {"foreach": False},
    "foreach": {"foreach": True},
    "differentiable": {"foreach": False, "differentiable": True},
    "capturable-forloop": {"foreach": False, "capturable": True},
    "capturable-foreach": {"foreach": True, "capturable": True},
}

ADAMAX_OPTIONS = {
    "plain": dict(lr=2e-2),
    "wd": dict(lr=2e-2, weight_decay=0.05),
    "maximize-betas-eps": dict(lr=2e-2, maximize=True, betas=(0.8, 0.95), eps=1e-3),
    "tensor-lr-wd": dict(lr=torch.tensor(2e-2), weight_decay=0.02),
}
NADAM_OPTIONS = {
    "plain": dict(lr=1e-2),
    "wd": dict(lr=1e-2, weight_decay=0.05),
    "decoupled-wd": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "momentum-decay-maximize-betas": dict(lr=1e-2, momentum_decay=0.05, maximize=True, betas=(0.85, 0.99)),
    "tensor-lr-decoupled-wd": dict(lr=torch.tensor(1e-2), weight_decay=0.1, decoupled_weight_decay=True),
}
RADAM_OPTIONS = {
    "plain": dict(lr=1e-2),
    "wd": dict(lr=1e-2, weight_decay=0.05),
    "decoupled-wd": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "maximize-betas-eps": dict(lr=1e-2, maximize=True, betas=(0.8, 0.99), eps=1e-6),
    "tensor-lr-wd": dict(lr=torch.tensor(1e-2), weight_decay=0.05),
    # rho_5 = 4.994 in double but 5.0026 in the capturable paths' float32: those rectify step 5, the others do not
    "rho-boundary-betas": dict(lr=1e-2, betas=(0.9, 0.9985)),
}
RADAM_STEPS = 7  # steps 1-5 SGD-like, 6-7 rectified
RADAM_WARMUP = 5


def _differentiable(opt):
    step = opt.step  # bound to the hooked step: the recorder's hooks still run inside

    def wrapped(*args, **kwargs):
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        try:
            return step(*args, **kwargs)
        finally:
            for p in params:
                p.requires_grad_(True)

    opt.step = wrapped
    return opt


def _cpu_capturable(opt):
    module = sys.modules[type(opt).__module__]  # torch.optim.nadam, ...: its functions look the check up there
    step = opt.step

    def wrapped(*args, **kwargs):
        with mock.patch.object(module, "_get_capturable_supported_devices", lambda supports_xla=True: ["cpu"]):
            return step(*args, **kwargs)

    opt.step = wrapped
    return opt


def _warm_up(opt, steps):
    """Take `steps` unrecorded steps on fixed pseudo-random gradients; recording then starts from that state."""
    g = torch.Generator().manual_seed(2)
    params = [p for group in opt.param_groups for p in group["params"]]
    for _ in range(steps):
        for p in params:
            p.grad = 0.1 * torch.randn(p.shape, generator=g)
        opt.step()
    for p in params:
        p.grad = None
    return opt


def _make(cls, kwargs, warmup=0):
    def make(groups):
        opt = cls(groups, **kwargs)
        if kwargs.get("differentiable"):
            opt = _differentiable(opt)
        if kwargs.get("capturable"):
            opt = _cpu_capturable(opt)
        return _warm_up(opt, warmup) if warmup else opt
    return make


def _perturb(options):
    return ("update", "lr") + (("weight_decay",) if options.get("weight_decay") else ())


def _cases(name, cls, option_sets, steps=4):
    return [Case(f"{name}-{opt_id}-{impl}", _make(cls, dict(options, **IMPLS[impl])), steps=steps,
                 perturb=_perturb(options), impl=impl)
            for opt_id, options in option_sets.items() for impl in IMPLS]


RADAM_WARM = dict(lr=1e-2, weight_decay=0.05)

CASES = (
    _cases("adamax", torch.optim.Adamax, ADAMAX_OPTIONS)
    + _cases("nadam", torch.optim.NAdam, NADAM_OPTIONS)
    + _cases("radam", torch.optim.RAdam, RADAM_OPTIONS, steps=RADAM_STEPS)
    + [Case(f"radam-warm-wd-{impl}", _make(torch.optim.RAdam, dict(RADAM_WARM, **IMPLS[impl]), RADAM_WARMUP),
            perturb=_perturb(RADAM_WARM), impl=impl) for impl in IMPLS]
    + [
        Case("adamax-wd-conv", _make(torch.optim.Adamax, dict(lr=2e-2, weight_decay=0.01)), model="conv",
             perturb=("update", "lr", "weight_decay")),
        Case("adamax-foreach-tensor-lr-attention", _make(torch.optim.Adamax, dict(lr=torch.tensor(2e-2), foreach=True)),
             model="attention"),
        Case("nadam-decoupled-wd-conv", _make(torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1,
                                                                      decoupled_weight_decay=True)),
             model="conv", perturb=("update", "lr", "weight_decay")),
        Case("nadam-foreach-momentum-decay-attention",
             _make(torch.optim.NAdam, dict(lr=1e-2, momentum_decay=0.01, foreach=True)), model="attention"),
        Case("radam-wd-conv", _make(torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.01)), model="conv",
             steps=RADAM_STEPS, perturb=("update", "lr", "weight_decay")),
        Case("radam-warm-foreach-decoupled-wd-attention",
             _make(torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, foreach=True),
                   RADAM_WARMUP), model="attention", perturb=("update", "lr", "weight_decay")),
    ]
)
