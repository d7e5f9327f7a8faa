"""Progress of the deploy commands (twinspark.deploy.progress) as a log sees it (not a terminal): sizes in units
that make sense, plain transfer lines, step times, and the one line Ctrl-C ends a step with."""

from __future__ import annotations

import pytest
from twinspark.deploy import progress
from twinspark.deploy.errors import DeployError


@pytest.mark.parametrize("n,text", [(0, "0 B"), (512, "512 B"), (1 << 20, "1.0 MiB"), (48 << 20, "48.0 MiB"),
                                    (int(197.3 * (1 << 30)), "197.3 GiB")])
def test_bytes_in_units_that_make_sense(n, text):
    assert progress.fmt_bytes(n) == text


def test_transfer_writes_lines_to_a_log(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    with progress.Transfer("rsync to w", 4 << 20) as bar:
        bar.update(1 << 20)
        bar.update(4 << 20)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("rsync to w: 1.0 MiB of 4.0 MiB (25%), ")
    assert err[-1].startswith("rsync to w: 4.0 MiB of 4.0 MiB (100%), ") and "left" not in err[-1]


def test_steps_time_each_step_and_ctrl_c_says_what_was_left(capsys):
    steps = progress.Steps()
    with steps.step("preflight", "nothing was changed"):
        pass
    with pytest.raises(progress.Interrupted) as e:
        with steps.step("sync (rsync)", lambda: "the copy resumes where it stopped"):
            raise KeyboardInterrupt
    assert isinstance(e.value, DeployError) and e.value.code == 130
    assert str(e.value).startswith("Interrupted during sync (rsync) after ")
    assert str(e.value).endswith(": the copy resumes where it stopped.")
    assert [(t.name, t.result) for t in steps.times] == [("preflight", "done"), ("sync (rsync)", "interrupted")]
    out = capsys.readouterr().err
    assert "-- preflight" in out and "   preflight: " in out
