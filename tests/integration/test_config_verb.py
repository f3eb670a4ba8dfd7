import subprocess
import sys


def test_config_verb_survives_a_closed_pipe():
    """`pretrainer config | head -3`: here the reader is gone before anything is written, which is
    the case that raises (a reader that takes one line leaves the rest in the pipe's buffer)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pretrainer", "config"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err
