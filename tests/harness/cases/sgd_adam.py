"""SGD, Adam and AdamW: every option, every CPU implementation."""
import torch

from . import Case

IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}

SGD_OPTIONS = {
    "plain": dict(lr=0.1),
    "momentum-dampening": dict(lr=0.05, momentum=0.9, dampening=0.3),
    "nesterov-wd": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    "maximize-wd": dict(lr=0.05, momentum=0.5, maximize=True, weight_decay=0.02),
}
ADAM_OPTIONS = {
    "plain": dict(lr=1e-2),
    "amsgrad-wd": dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    "maximize-betas": dict(lr=1e-2, maximize=True, betas=(0.8, 0.99)),
    "decoupled-wd": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
}
ADAMW_OPTIONS = {
    "wd": dict(lr=1e-2, weight_decay=0.1),
    "amsgrad-maximize": dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True),
}


def _perturb(options):
    return ("update", "lr") + (("weight_decay",) if options.get("weight_decay") else ())


def _cases(name, cls, option_sets, impls):
    out = []
    for opt_id, options in option_sets.items():
        for impl in impls:
            kwargs = dict(options, **IMPLS[impl])
            out.append(Case(f"{name}-{opt_id}-{impl}", lambda groups, cls=cls, kw=kwargs: cls(groups, **kw),
                            perturb=_perturb(options), impl=impl))
    return out


CASES = (
    _cases("sgd", torch.optim.SGD, SGD_OPTIONS, IMPLS)
    + _cases("adam", torch.optim.Adam, ADAM_OPTIONS, IMPLS)
    + _cases("adamw", torch.optim.AdamW, ADAMW_OPTIONS, IMPLS)
    + [
        Case("sgd-tensor-lr-conv", lambda g: torch.optim.SGD(g, lr=torch.tensor(0.05), momentum=0.9), model="conv"),
        Case("adam-tensor-lr-betas-attention",
             lambda g: torch.optim.Adam(g, lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99))),
             model="attention"),
        Case("adamw-fused-attention", lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True), model="attention"),
        Case("sgd-nesterov-conv", lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
             model="conv"),
    ]
)
