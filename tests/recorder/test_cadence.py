"""The default cadence of full records and the size warning (upd/recorder/cadence.py): pure arithmetic."""
from upd.recorder import cadence


def test_the_default_cadence_thins_out_with_the_record_size():
    six_m = cadence.full_record_bytes(4 * 5_800_000, cadence.state_tensors("torch.optim.AdamW"))
    gpt2 = cadence.full_record_bytes(4 * 124_439_808, cadence.state_tensors("AdamW"))
    assert six_m == 116_000_000 and cadence.default_every(six_m) == 200
    assert cadence.default_every(gpt2) == 5000
    assert cadence.default_every(1_000_000) == cadence.DEFAULT_EVERY  # a small model: every 100
    assert [s for s in range(450) if cadence.is_full_step(s, 200)] == [0, 1, 200, 400]


def test_one_warning_names_the_projected_size_and_the_cadence_that_fits():
    record = cadence.full_record_bytes(4 * 60_000, 2)  # the 60k-parameter model: 1.2 MB a record
    assert cadence.size_warning(record, 100) is None
    text = cadence.size_warning(record, 1)
    assert "1.2 GB per 1,000 steps" in text and "every=100" in text and "bfloat16" in text
    assert cadence.bytes_per_1000_steps(record, None) == 0
