"""Progress bars of the command lines (`python -m pyfa`, `python -m pyfa.sim report|sweep`):
plain text on stderr, drawn only when stderr is a terminal or --progress asks, never with
--no-progress, and only once a call has run PROGRESS_DELAY_S; and the demo's HBM-IO line
for standard attention beside FA2's."""

import io
import re

import pytest

import pyfa
from pyfa.sim import report
from pyfa.sim.io import format_bytes


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


BAR = re.compile(r"\r(?P<label>[^\[\r]+) \[(?P<bar>[#.]{30})\] +(?P<count>\S+) +[\d.]+s")


def bars(text):
    return [m.groupdict() for m in BAR.finditer(text)]


def test_callback_bar_draws_percentages_that_never_fall_and_never_cancels():
    out = io.StringIO()
    bar = report.Progress(1, "kernel", True, stream=out)
    # Library threads may report out of order: the bar keeps the furthest point.
    assert [bar(done, 200) for done in (50, 20, 200)] == [None, None, None]
    bar.close()
    drawn = bars(out.getvalue())
    assert drawn[0]["count"] == "25%" and drawn[-1]["count"] == "100%"
    assert drawn[-1]["bar"] == "#" * 30
    percents = [int(d["count"][:-1]) for d in drawn]
    assert percents == sorted(percents)
    assert out.getvalue().endswith("\n")


def test_bar_waits_for_its_delay_and_leaves_no_trace_before():
    out = io.StringIO()
    bar = report.Progress(4, "sweep", True, stream=out, delay=3600)
    for _ in range(4):
        bar.step("x")
    bar(10, 10)
    bar.close()
    assert out.getvalue() == ""


def test_progress_wanted_follows_the_flag_then_the_terminal():
    assert report.progress_wanted(None, FakeTerminal()) is True
    assert report.progress_wanted(None, io.StringIO()) is False
    assert report.progress_wanted(True, io.StringIO()) is True
    assert report.progress_wanted(False, FakeTerminal()) is False


@pytest.fixture
def no_delay(monkeypatch):
    # Every call of these tests is short; the delay is what a user's terminal gets.
    monkeypatch.setattr(report, "PROGRESS_DELAY_S", 0.0)


def run_main(main, argv, monkeypatch, capsys, stderr):
    monkeypatch.setattr("sys.stderr", stderr)
    code = main(argv)
    return code, capsys.readouterr().out, stderr.getvalue()


SIM_COMMANDS = {
    "report": ["report", "--preset", "gpt2-medium"],
    "sweep": ["sweep", "--over", "bc", "--preset", "gpt2-medium", "--values", "32,64"],
}


@pytest.mark.parametrize("command", list(SIM_COMMANDS))
@pytest.mark.parametrize("flag, terminal, shown", [
    ([], True, True), ([], False, False), (["--progress"], False, True),
    (["--no-progress"], True, False)])
def test_sim_commands_show_a_bar_on_a_terminal_or_when_asked(command, flag, terminal, shown,
                                                            no_delay, monkeypatch, capsys):
    stderr = FakeTerminal() if terminal else io.StringIO()
    code, out, err = run_main(report.main, SIM_COMMANDS[command] + flag, monkeypatch, capsys,
                              stderr)
    assert code == 0 and "HBM" in out
    drawn = bars(err)
    if shown:
        assert drawn and drawn[-1]["bar"] == "#" * 30 and err.endswith("\n")
        done, total = drawn[-1]["count"].split("/")
        assert done == total
    else:
        assert err == ""


def test_sim_bar_stays_off_stdout(no_delay, monkeypatch, capsys):
    code, out, err = run_main(report.main, SIM_COMMANDS["sweep"] + ["--progress"], monkeypatch,
                              capsys, io.StringIO())
    assert code == 0 and bars(err) and "\r" not in out and "[#" not in out


def demo_backend():
    for backend in ("cpu", "emu"):
        if backend in pyfa.backends():
            return backend
    pytest.skip("neither host backend runs here")


@pytest.mark.parametrize("flag, terminal, shown", [
    ([], True, True), ([], False, False), (["--progress"], False, True),
    (["--no-progress"], True, False)])
def test_demo_shows_a_bar_per_call_on_a_terminal_or_when_asked(flag, terminal, shown, no_delay,
                                                               monkeypatch, capsys):
    from pyfa import __main__ as demo
    monkeypatch.setattr(demo, "PROGRESS_DELAY_S", 0.0)
    backend = demo_backend()
    stderr = FakeTerminal() if terminal else io.StringIO()
    code, out, err = run_main(demo.main, ["--seqlen", "128", "--backend", backend] + flag,
                              monkeypatch, capsys, stderr)
    # The bar is only drawn: the results are the simulator's bits all the same.
    assert code == 0 and "bit for bit: yes" in out
    drawn = bars(err)
    if shown:
        labels = [d["label"] for d in drawn]
        assert f"kernel ({backend})" in labels and "simulator" in labels
        for label in (f"kernel ({backend})", "simulator"):
            assert [d for d in drawn if d["label"] == label][-1]["count"] == "100%"
    else:
        assert err == ""


def test_demo_sets_standard_attentions_bytes_beside_fa2s(monkeypatch, capsys):
    from pyfa import __main__ as demo
    backend = demo_backend()
    code, out, _ = run_main(demo.main, ["--seqlen", "96", "--heads", "2", "--causal",
                                        "--backend", backend], monkeypatch, capsys, io.StringIO())
    assert code == 0
    shape = dict(batch=1, heads=2, seqlen_q=96, seqlen_k=96, head_dim=64, causal=True)
    for label, algo in (("FA2 (simulated above)", "fa2"),
                        ("standard attention (unfused)", "standard")):
        (line,) = [x for x in out.splitlines() if x.startswith(label)]
        record = pyfa.sim.count_io(algo, **shape)
        totals = re.findall(r"\d+(?:\.\d+)? \S*B", line)
        assert totals == [format_bytes(record.total_reads), format_bytes(record.total_writes),
                          format_bytes(record.total)], line
    fa2, standard = (pyfa.sim.count_io(a, **shape).total for a in ("fa2", "standard"))
    assert f"standard attention moves {standard / fa2:.2f}x FA2's bytes" in out
