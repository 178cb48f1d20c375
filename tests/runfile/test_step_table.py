"""The pure parts of the one step table: rows of both tables per step, model order, statistics rows' hparams."""
import numpy as np
import pandas as pd

from upd.runfile.stats_table import hparams_rows, hparams_text
from upd.runfile.step_table import model_order, step_frame


def test_a_step_with_both_rows_is_one_row_and_statistics_only_steps_get_theirs():
    records = (np.array([0, 4]), np.array([2, 10]), np.array([0.0, 4.0]), np.array([[0.1], [0.3]]))
    stats = (np.array([0, 1, 2, 3, 4, 5]), np.arange(2, 14, 2), np.arange(6.0), np.array([[0.1, 1.0]] * 6))
    table = step_frame(0, records, stats)
    assert table["step"].tolist() == list(range(6))
    assert table["record"].tolist() == [0, pd.NA, pd.NA, pd.NA, 1, pd.NA]
    assert table["stats_row"].tolist() == list(range(6))
    assert table["backward_pass"].tolist() == [2, 4, 6, 8, 10, 12]
    assert table["lr_group0"].tolist() == [0.1, 0.1, 0.1, 0.1, 0.3, 0.1]  # a record's own values at its step
    assert table["lr_group1"].tolist()[1:4] == [1.0, 1.0, 1.0]  # a group only the statistics rows saw


def test_model_order_follows_group_and_index_not_names():
    names = [("10.weight", 0, 5), ("2.weight", 0, 1), ("0.bias", 1, 0), ("0.weight", 0, 0), ("odd", "x", None)]
    ordered = model_order([{"name": n, "group": g, "index_in_group": i} for n, g, i in names])
    assert [e["name"] for e in ordered] == ["0.weight", "odd", "2.weight", "10.weight", "0.bias"]


def test_statistics_rows_store_hparams_when_they_change_and_take_lr_from_its_column():
    groups = [{"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.1, "weight_decay": 0.0}]
    text = hparams_text(groups)
    assert "lr" not in text
    lr = np.array([[0.1, 0.1], [0.05, 0.05], [0.05, np.nan]])
    rows = hparams_rows([text, "", "[["], lr)
    assert rows[1] == [{"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.05, "weight_decay": 0.0}]
    assert rows[2] is None  # a row whose text is not a list of groups: unknown, not guessed
    assert hparams_rows(["", text], lr[:2])[0] is None  # no text before it
