"""The update:data ratio of a complex parameter: defined on its real and imaginary parts as pairs of real numbers
(upd.ratios.real_numbers), the same from the full tensors and from the recorder's statistics, without a warning."""
import math
import warnings

import pytest
import torch
from torch import nn

import upd


def test_complex_ratios_use_real_and_imaginary_parts(tmp_path):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    opt = torch.optim.SGD([weight], lr=0.05)
    path = tmp_path / "run.h5"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # casting complex to real would warn (and drop the imaginary part)
        with upd.record(path, optimizer=opt, stats_every=1, every=1):
            for _ in range(3):
                opt.zero_grad()
                (weight.abs() ** 2 + weight.imag).sum().backward()
                opt.step()
        with upd.open_run(path) as run:
            p = run.param("group0.param0")
            from_tensors = run.ratios(source="tensors")
            from_stats = run.ratios(source="stats")
            rows = [(p.read("param", row), p.read("param_after", row)) for row in range(3)]
    for row, (before, after) in enumerate(rows):
        pairs = lambda t: torch.view_as_real(t).double().flatten()  # noqa: E731
        expected = math.log10(float(pairs(after - before).std()) / float(pairs(before).std()))
        real_part_only = math.log10(float((after - before).real.double().std()) / float(before.real.double().std()))
        assert from_tensors["update_to_data"].iloc[row] == pytest.approx(expected, rel=1e-9)
        assert from_stats["update_to_data"].iloc[row] == pytest.approx(expected, rel=1e-4)
        assert abs(expected - real_part_only) > 1e-3  # the real part alone gives another number: the check can fail
