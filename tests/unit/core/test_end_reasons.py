"""The one table of how runs end: every row's exit code, tracker status, alert kind and checkpoint,
the exception each comes from, which stop wins, and the CLI's code and line, all from the table."""

import errno
import signal

import pytest

from pretrainer.cli.main import ending_line
from pretrainer.core.end_reasons import BY_NAME, END_REASONS, STOPS, end_reason_of, exit_status, first_stop
from pretrainer.core.errors import RunStopped, UserError, WriteFault

# name -> (an exception that ends a run that way, exit code, tracker status, alert kind, checkpoint)
EXPECTED = {
    "finished": (None, 0, "FINISHED", "finished", True),
    "run_dir_lost": (RunStopped("RUN: moved", 2, "run_dir_lost"), 2, "FAILED", "died", False),
    "budget_halt": (RunStopped("spent", 5, "budget_halt"), 5, "KILLED", "stopped", False),
    "budget_stop": (RunStopped("projected", 4, "budget_stop"), 4, "KILLED", "stopped", True),
    "throughput_stop": (RunStopped("slow", 6, "throughput_stop"), 6, "KILLED", "stopped", True),
    "signal": (RunStopped("SIGUSR1", 128 + signal.SIGUSR1, "signal"), 138, "KILLED", "stopped", True),
    "time_limit": (RunStopped("job ends", 8, "time_limit"), 8, "KILLED", "stopped", True),
    "error": (UserError("data/x: not found"), 2, "FAILED", "died", False),
    "write_fault": (OSError(errno.ENOSPC, "No space left on device", "/runs/a"), 7, "FAILED", "died", False),
    "collective_timeout": (
        RuntimeError("Watchdog caught collective operation timeout"),
        3,
        "FAILED",
        "died",
        False,
    ),
    "crash": (ZeroDivisionError("a bug"), 1, "FAILED", "died", False),
}


def test_the_table_and_the_expectations_name_the_same_reasons():
    assert set(BY_NAME) == set(EXPECTED) and len(BY_NAME) == len(END_REASONS)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_reason_derives_its_code_status_alert_and_checkpoint_from_its_row(name):
    error, code, status, alert, checkpoint = EXPECTED[name]
    reason = end_reason_of(error)
    assert reason.name == name
    assert reason.exit_code(error) == code
    assert (reason.tracker_status, reason.alert_kind, reason.checkpoint) == (status, alert, checkpoint)
    # exit.json's reason: a crash is recorded as "error" (its code, 1, tells it from bad input's 2)
    assert exit_status(error) == ("error" if name == "crash" else name, code)


@pytest.mark.parametrize("name", [n for n in EXPECTED if n not in ("finished", "crash")])
def test_the_cli_ends_each_reason_with_one_line_and_the_row_s_code(name):
    error, code, *_ = EXPECTED[name]
    line = ending_line(end_reason_of(error), error)
    assert "\n" not in line and line.startswith(("error: ", "stopped: "))
    if name == "write_fault":
        assert "no space left on the device" in line and "/runs/a" in line
    if name == "collective_timeout":
        assert "parallel.timeout_s" in line


def test_a_keyboard_interrupt_is_a_signal_stop_with_130():
    reason = end_reason_of(KeyboardInterrupt())
    assert reason.name == "signal" and reason.exit_code(KeyboardInterrupt()) == 130
    assert ending_line(reason, KeyboardInterrupt()) == "interrupted"


def test_stops_at_the_same_step_the_one_with_the_lowest_priority_number_wins():
    assert STOPS == ("run_dir_lost", "budget_halt", "budget_stop", "throughput_stop", "signal", "time_limit")
    assert first_stop(["budget_halt", "run_dir_lost"]).name == "run_dir_lost"
    assert first_stop(["time_limit", "signal"]).name == "signal"
    assert first_stop(["signal", "budget_halt", "throughput_stop"]).name == "budget_halt"
    assert first_stop(["throughput_stop", "budget_stop"]).name == "budget_stop"
    assert first_stop([]) is None
    priorities = [BY_NAME[name].priority for name in STOPS]
    assert priorities == sorted(priorities) and len(set(priorities)) == len(priorities)


def test_a_write_fault_raised_as_such_is_one_too():
    assert end_reason_of(WriteFault("x: cannot write")).name == "write_fault"
