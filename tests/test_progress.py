"""``launch.progress``: a resumed run's record holds every epoch (pure Python)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from launch import progress

FIELDS = {"train_s_per_epoch": [10.0, 21.0, 30.5], "epoch_wall_s": [15.0, 27.0, 38.0],
          "eval_s_per_epoch": [1.0, 1.1, 0.9], "backup_s_per_epoch": [0.2, 0.3, 0.2]}
HISTORY = {"loss": [2.0, 1.0, 0.5], "val_accuracy": [0.5, 0.7, 0.8]}


def test_a_fresh_run_is_its_own_history():
    history, fields, gap = progress.merge(None, 0, HISTORY, FIELDS)
    assert history == HISTORY and fields == FIELDS and gap == 0


def test_a_resumed_run_prepends_the_saved_epochs_and_continues_the_clocks(tmp_path):
    progress.write(str(tmp_path), 3, HISTORY, FIELDS)
    saved = progress.read(str(tmp_path))
    assert saved["epochs"] == 3 and not list(tmp_path.glob("*.tmp"))
    # killed after epoch 2's backup (epoch 3 saved here too: only the first 2 are taken)
    now = {"train_s_per_epoch": [12.0], "epoch_wall_s": [20.0], "eval_s_per_epoch": [1.2],
           "backup_s_per_epoch": [0.25]}
    history, fields, gap = progress.merge(saved, 2, {"loss": [0.4], "val_accuracy": [0.81]},
                                          now)
    assert gap == 0
    assert history == {"loss": [2.0, 1.0, 0.4], "val_accuracy": [0.5, 0.7, 0.81]}
    assert fields["train_s_per_epoch"] == [10.0, 21.0, 33.0]  # cumulative: continued
    assert fields["epoch_wall_s"] == [15.0, 27.0, 47.0]
    assert fields["eval_s_per_epoch"] == [1.0, 1.1, 1.2]  # per epoch: appended
    assert fields["backup_s_per_epoch"] == [0.2, 0.3, 0.25]


def test_saved_epochs_that_do_not_cover_the_resume_are_named_not_guessed(tmp_path):
    assert progress.read(str(tmp_path)) is None and progress.read(None) is None
    progress.write(str(tmp_path), 1, {"loss": [2.0]}, {"train_s_per_epoch": [10.0]})
    saved = json.loads((tmp_path / progress.PROGRESS_FILE).read_text())
    for before in (None, saved):
        history, fields, gap = progress.merge(before, 2, {"loss": [0.4]},
                                              {"train_s_per_epoch": [5.0]})
        assert gap == 2 and history == {"loss": [0.4]}
        assert fields["train_s_per_epoch"] == [5.0] and fields["epoch_wall_s"] == []


@settings(max_examples=50, deadline=None)
@given(total=st.integers(1, 8), data=st.data())
def test_merge_splits_and_rejoins_any_run(total, data):
    """Saving a run's first epochs and merging the rest gives the whole run back (the
    cumulative clocks re-based on the saved epoch)."""
    resume = data.draw(st.integers(0, total - 1))
    steps = data.draw(st.lists(st.floats(0.1, 100.0), min_size=total, max_size=total))
    cumulative = [round(sum(steps[:i + 1]), 3) for i in range(total)]
    history = {"loss": [float(i) for i in range(total)]}
    fields = {"train_s_per_epoch": cumulative, "eval_s_per_epoch": steps}
    saved = {"epochs": total, "history": history,
             **{k: fields.get(k, []) for k in progress.EPOCH_FIELDS}}
    rest = {"train_s_per_epoch": [round(c - (cumulative[resume - 1] if resume else 0.0), 3)
                                  for c in cumulative[resume:]],
            "eval_s_per_epoch": steps[resume:]}
    got, got_fields, gap = progress.merge(saved, resume,
                                          {"loss": history["loss"][resume:]}, rest)
    assert gap == 0 and got == history
    assert got_fields["eval_s_per_epoch"] == steps
    for a, b in zip(got_fields["train_s_per_epoch"], cumulative):
        assert abs(a - b) < 2e-3
