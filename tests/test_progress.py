"""Console progress of long stages: plain lines when redirected, silence when asked."""
from __future__ import annotations

from gnnlm.utils.progress import Progress, say, track


def test_track_yields_the_chunks_left_and_stops_when_asked():
    assert list(track(5, "demo")) == [0, 1, 2, 3, 4]
    assert list(track(5, "demo", initial=3)) == [3, 4]
    assert list(track(5, "demo", initial=1, stop_after=2)) == [1, 2]
    assert list(track(5, "demo", stop_after=0)) == []
    assert list(track(2, "demo", initial=2)) == []


def test_redirected_progress_is_plain_lines(monkeypatch, capsys):
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")
    for _ in track(3, "features valid"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines)
    assert lines[-1].strip().startswith("features valid: 3/3 chunks")
    assert [line.split(":")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"]


def test_the_last_line_is_written_even_between_intervals(monkeypatch, capsys):
    """At most one line per interval, plus the last, so a log always ends with the total."""
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "1000")
    for _ in track(4, "index final-cos"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines and "index final-cos: 4/4 chunks" in lines[-1]


def test_quiet_silences_everything(monkeypatch, capsys):
    monkeypatch.setenv("GNNLM_QUIET", "1")
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")
    say("[gnnlm] stage done")
    list(track(3, "demo"))
    assert capsys.readouterr().err == ""


def test_progress_line_counts_rate_and_eta(monkeypatch):
    monkeypatch.setenv("GNNLM_QUIET", "1")
    bar = Progress(10, "neighbours train", initial=4)
    bar.t0 -= 2.0                                                     # two seconds ago
    bar.update(2)
    line = bar.line()
    assert line.startswith("neighbours train: 6/10 chunks, ")
    assert "1.00 chunk/s" in line or "0.99 chunk/s" in line          # 2 chunks in ~2 s
    assert "ETA 4s" in line or "ETA 3s" in line
    bar.close()
