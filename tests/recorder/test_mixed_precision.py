"""Mixed precision: under torch.amp.GradScaler a fused optimizer is handed the scaled gradients and the scale; the run
shows the gradients as the optimizer used them, and records the scale and found_inf with the step."""
import numpy as np
import pytest
import torch

import upd
from upd.runfile import schema

from tests.harness.grad_scaler import SCALE, train

MODES = {"full": dict(every=1, stats_every=1), "lean statistics": dict(every=None, stats_every=1),
         "full statistics": dict(every=None, stats_every=1, full_stats_every=1),
         "sampled statistics": dict(every=None, stats_every=1, stats_sample=256)}
GRAD_COLUMNS = ["grad_mean", "grad_std", "grad_norm", "grad_absmax", "grad_zero_frac", "grad_nonfinite",
                "grad_to_data"]


# Every mode with the fused optimizer (the one GradScaler hands the scale); foreach (the scaler unscales for it, as
# for any other optimizer) in one mode of each kind.
CASES = [(mode, True) for mode in MODES] + [("full", False), ("lean statistics", False)]


@pytest.mark.slow
@pytest.mark.parametrize("mode,fused", CASES, ids=[f"{m}-{'fused' if f else 'foreach'}" for m, f in CASES])
def test_gradients_read_as_the_same_run_without_a_scaler(tmp_path, mode, fused):
    options = MODES[mode]
    plain = train(str(tmp_path / "plain.h5"), scaler=False, fused=fused, **options)
    for unscale in (False, True):
        scaled = train(str(tmp_path / f"scaled-{unscale}.h5"), scaler=True, fused=fused, unscale=unscale, **options)
        with upd.open_run(plain) as a, upd.open_run(scaled) as b:
            _assert_same_gradients(a, b, options, fused, unscale)


def _assert_same_gradients(a, b, options, fused, unscale):
    sa, sb = a.stats(), b.stats()
    assert len(sa) == len(sb) == 4 * 4
    columns = [c for c in GRAD_COLUMNS if c in sa.columns]
    assert "grad_to_data" in columns
    # Exact: the scale is a power of two (grad_to_data would be log10(2^10) = +3.01 off, still scaled).
    np.testing.assert_array_equal(sb[columns].to_numpy(), sa[columns].to_numpy())
    if options["every"]:
        names = [p.name for p in a.iter_params()]
        assert len(names) == 4
        for name in names:
            assert torch.equal(b.param(name).read(schema.KIND_GRAD), a.param(name).read(schema.KIND_GRAD)), name
    scalars_a, scalars_b = a.scalars(), b.scalars()
    if fused:
        assert (scalars_b[schema.SCALAR_AMP_GRAD_SCALE] == (1.0 if unscale else SCALE)).all()
        assert (scalars_b[schema.SCALAR_AMP_FOUND_INF] == 0).all()
    else:  # the scaler unscaled the gradients itself: nothing of it reaches the optimizer
        assert schema.SCALAR_AMP_GRAD_SCALE not in scalars_b.columns
    np.testing.assert_allclose(scalars_b[schema.SCALAR_GRAD_NORM_AT_STEP],
                               scalars_a[schema.SCALAR_GRAD_NORM_AT_STEP], rtol=1e-6)
    if fused and not unscale:  # after unscale_ the step is handed no scale: the backward norm stays scaled
        np.testing.assert_allclose(scalars_b[schema.SCALAR_GRAD_NORM_BACKWARD],
                                   scalars_a[schema.SCALAR_GRAD_NORM_BACKWARD], rtol=1e-6)


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step only", "unscale_ first"])
def test_a_skipped_step_is_recorded_with_found_inf(tmp_path, unscale):
    path = train(str(tmp_path / "run.h5"), scaler=True, fused=True, unscale=unscale, inf_steps=(1,), every=1,
                 stats_every=1)
    with upd.open_run(path) as run:
        scalars = run.scalars().set_index("step")
        assert scalars[schema.SCALAR_AMP_FOUND_INF].tolist() == [0.0, 1.0, 0.0, 0.0]
        # the scaler halves its scale after the skipped step
        expected = [1.0] * 4 if unscale else [SCALE, SCALE, SCALE / 2, SCALE / 2]
        assert scalars[schema.SCALAR_AMP_GRAD_SCALE].tolist() == expected
        stats = run.stats().set_index(["param", "step"])
        assert stats.loc[("fc1.weight", 1), "grad_nonfinite"] == 1
        assert stats.loc[("fc1.weight", 1), "update_norm"] == 0  # the fused kernel changed nothing
        weight = run.param("fc1.weight")
        assert torch.equal(weight.read(schema.KIND_PARAM, 1), weight.read(schema.KIND_PARAM_AFTER, 1))
