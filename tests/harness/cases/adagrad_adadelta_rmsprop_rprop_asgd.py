"""Adagrad, Adadelta, RMSprop, Rprop and ASGD: every option, every CPU implementation.

CPU implementations: for-loop (foreach=False) and foreach for all five, plus fused for Adagrad. capturable=True
is refused on CPU by all of them (Adagrad has no such option), and differentiable=True cannot step the leaf
parameters of an nn.Module (torch raises "a leaf Variable that requires grad is being used in an in-place
operation"), so neither can be recorded here.

Perturbations: "update" always; "weight_decay" where the case has weight decay; "lr" where the lr of record 2 is
used. That excludes Rprop, whose lr only sets the initial step sizes (its state from step 0 on): a wrong lr at
record 2 changes nothing torch computes, so verify must (and does) pass it. The "rprop-lr-step0" case records a
single step, so the harness perturbs record 0, where the lr is used. ASGD's step uses the eta computed at the
previous step, so its lr is checked through the new eta in the state compared at the next record.
"""
import torch

from . import Case

IMPLS = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
NO_FUSED = ("forloop", "foreach")

ADAGRAD_OPTIONS = {
    "plain": dict(lr=0.05),
    "lr_decay-init-eps": dict(lr=0.05, lr_decay=0.2, initial_accumulator_value=0.1, eps=1e-3),
    "wd-maximize": dict(lr=0.05, weight_decay=0.1, maximize=True),
    "tensor-lr": dict(lr=torch.tensor(0.05), lr_decay=0.1),
}
ADADELTA_OPTIONS = {
    "plain": dict(lr=1.0),
    "rho-eps": dict(lr=0.5, rho=0.8, eps=1e-4),
    "wd-maximize": dict(lr=1.0, weight_decay=0.1, maximize=True),
    "tensor-lr": dict(lr=torch.tensor(0.5)),
}
RMSPROP_OPTIONS = {
    "plain": dict(lr=1e-2),
    "centered-alpha": dict(lr=1e-2, centered=True, alpha=0.9),
    "momentum": dict(lr=1e-2, momentum=0.9),
    "centered-momentum-wd-maximize": dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.1, maximize=True,
                                          eps=1e-6),
    "tensor-lr": dict(lr=torch.tensor(1e-2), momentum=0.5),
}
RPROP_OPTIONS = {
    "plain": dict(lr=0.01),
    # step sizes reach both clamps within 4 steps: 0.01 * 1.5^2 > 0.02, 0.01 * 0.3^2 < 1e-3
    "etas-step_sizes": dict(lr=0.01, etas=(0.3, 1.5), step_sizes=(1e-3, 2e-2)),
    "maximize": dict(lr=0.01, maximize=True),
    "tensor-lr": dict(lr=torch.tensor(0.01)),
}
ASGD_OPTIONS = {
    "plain": dict(lr=0.01),
    # t0=0 starts averaging ax at once (mu = 1/2, 1/3 from the third step); lambd and alpha change eta visibly
    "lambd-alpha-t0": dict(lr=0.05, lambd=0.1, alpha=0.5, t0=0.0),
    "wd-maximize": dict(lr=0.01, weight_decay=0.1, maximize=True, t0=1.0),
    "tensor-lr": dict(lr=torch.tensor(0.05), lambd=0.1, t0=0.0),
}


def _perturb(options, uses_lr=True):
    return ("update",) + (("lr",) if uses_lr else ()) + (("weight_decay",) if options.get("weight_decay") else ())


def _cases(name, cls, option_sets, impls, uses_lr=True):
    out = []
    for opt_id, options in option_sets.items():
        for impl in impls:
            kwargs = dict(options, **IMPLS[impl])
            out.append(Case(f"{name}-{opt_id}-{impl}", lambda groups, cls=cls, kw=kwargs: cls(groups, **kw),
                            perturb=_perturb(options, uses_lr), impl=impl))
    return out


CASES = (
    _cases("adagrad", torch.optim.Adagrad, ADAGRAD_OPTIONS, IMPLS)
    + _cases("adadelta", torch.optim.Adadelta, ADADELTA_OPTIONS, NO_FUSED)
    + _cases("rmsprop", torch.optim.RMSprop, RMSPROP_OPTIONS, NO_FUSED)
    + _cases("rprop", torch.optim.Rprop, RPROP_OPTIONS, NO_FUSED, uses_lr=False)
    + _cases("asgd", torch.optim.ASGD, ASGD_OPTIONS, NO_FUSED)
    + [
        # sparse gradients (Adagrad's sparse path; foreach falls back to it; fused refuses sparse)
        Case("adagrad-sparse-forloop", lambda g: torch.optim.Adagrad(g, lr=0.05, lr_decay=0.1, foreach=False),
             sparse=True),
        Case("adagrad-sparse-foreach", lambda g: torch.optim.Adagrad(g, lr=0.05, maximize=True, foreach=True),
             sparse=True),
        Case("adagrad-wd-conv", lambda g: torch.optim.Adagrad(g, lr=0.05, weight_decay=0.05), model="conv",
             perturb=("update", "lr", "weight_decay")),
        Case("adagrad-fused-attention", lambda g: torch.optim.Adagrad(g, lr=0.05, lr_decay=0.1, fused=True),
             model="attention"),
        Case("adadelta-conv", lambda g: torch.optim.Adadelta(g, lr=1.0, rho=0.8), model="conv"),
        Case("adadelta-foreach-attention", lambda g: torch.optim.Adadelta(g, lr=1.0, foreach=True),
             model="attention"),
        Case("rmsprop-centered-momentum-conv", lambda g: torch.optim.RMSprop(g, lr=1e-2, centered=True, momentum=0.9),
             model="conv"),
        Case("rmsprop-foreach-centered-attention",
             lambda g: torch.optim.RMSprop(g, lr=1e-2, centered=True, foreach=True), model="attention"),
        Case("rprop-conv", lambda g: torch.optim.Rprop(g, lr=0.01, etas=(0.4, 1.3)), model="conv",
             perturb=("update",)),
        Case("rprop-foreach-attention", lambda g: torch.optim.Rprop(g, lr=0.01, foreach=True), model="attention",
             perturb=("update",)),
        # one step: the harness perturbs record 0, the only step whose lr Rprop uses (initial step sizes)
        Case("rprop-lr-step0", lambda g: torch.optim.Rprop(g, lr=0.01), steps=1, perturb=("update", "lr")),
        Case("asgd-lambd-t0-conv", lambda g: torch.optim.ASGD(g, lr=0.05, lambd=0.1, t0=0.0), model="conv"),
        Case("asgd-foreach-wd-attention",
             lambda g: torch.optim.ASGD(g, lr=0.05, t0=1.0, weight_decay=0.05, foreach=True), model="attention",
             perturb=("update", "lr", "weight_decay")),
    ]
)
