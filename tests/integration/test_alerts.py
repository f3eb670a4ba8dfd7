"""Alerts reach a person: a real run's budget warning, spike, stall and end arrive at a webhook (a
local HTTP server on 127.0.0.1 standing in for Slack); an endpoint that hangs or answers 500 changes
neither the losses nor the wall time beyond noise; the URL (a secret) is in no file of the run."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
from helpers import losses, tiny_config
from support.budget_helpers import FakeClock, budget_file

from pretrainer.artifacts.metrics import read_metrics
from pretrainer.core.secrets import forget_secrets
from pretrainer.train.alerts import POST_TIMEOUT_S, forecast_loss
from pretrainer.train.loop import train

SECRET = "T000/B000/XXXXsecretXXXX"
pytestmark = pytest.mark.quiet  # the module's runs compare wall times (a stall drill, an endpoint that hangs)


class Webhook(http.server.ThreadingHTTPServer):
    """A webhook endpoint that records each JSON POST. mode "ok" answers 200; "bad" answers the first
    with a 500 and hangs on every other (the sender retries the first, then waits out its timeout)."""

    daemon_threads = True

    def __init__(self, mode: str):
        self.mode, self.received = mode, []
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/services/{SECRET}"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.received.append(body)
        if self.server.mode == "bad" and len(self.server.received) > 1:
            time.sleep(30)
        self.send_response(500 if self.server.mode == "bad" else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def alerted_run(stdlib_data, run, url: str) -> float:
    """A run with a budget warning (budget.json says $31 of a $35 cap spent), an LR spike drill at step
    30 and a stall drill (a 0.8 s pause before step 40) -> its wall time in seconds."""
    settings = {
        "train.max_steps": 50,
        "eval.every": 0,
        "ckpt.every": 1000,
        "log.every": 5,
        "budget.cap_usd": 35,
        "budget.warn_usd": 30,
        "budget.usd_per_gpu_hour": 1.1,
        "budget.file": budget_file(run.parent / f"{run.name}-budget.json", spent=31, projected=34),
        "spike.inject_at_step": 30,
        "spike.inject_kind": "lr",
        "spike.lr_factor": 1000,
        "spike.min_values": 10,
        "spike.window": 20,
        "alerts.stall_drill_step": 40,
        "alerts.stall_drill_s": 0.8,
        "alerts.stall_min_s": 0.3,
        "alerts.stall_factor": 2,
        "alerts.webhook_url": url,
    }
    forget_secrets()
    cfg = tiny_config(stdlib_data, run, **settings)
    started = time.monotonic()
    train(cfg, clock=FakeClock())
    return time.monotonic() - started


@pytest.fixture(scope="module")
def endpoints(stdlib_data, tmp_path_factory) -> dict:
    """The same run against an endpoint that answers and one that hangs, then fails."""
    root = tmp_path_factory.mktemp("alerts")
    out = {}
    for mode in ("ok", "bad"):
        hook = Webhook(mode)
        out[mode] = (root / mode, alerted_run(stdlib_data, root / mode, hook.url), hook)
    yield out
    for _, _, hook in out.values():
        hook.shutdown()


def test_budget_spike_stall_and_the_end_reach_the_webhook(endpoints):
    run, _, hook = endpoints["ok"]
    events = [message["event"] for message in hook.received]
    assert events[0] == "budget_warning" and events[-1] == "finished", events
    assert {"spike", "stall"} <= set(events) or {"non_finite", "stall"} <= set(events), events
    assert all(
        message["text"] == message["content"] and run.name in message["text"] for message in hook.received
    )
    logged = [r["alert"] for r in read_metrics(run / "metrics.jsonl") if "alert" in r]
    # each alert is an event in metrics.jsonl; a kind repeated within a minute is not sent again
    assert list(dict.fromkeys(logged)) == events


def test_an_endpoint_that_hangs_or_fails_changes_neither_losses_nor_wall_time(endpoints):
    (ok, ok_time, _), (bad, bad_time, hook) = endpoints["ok"], endpoints["bad"]
    assert len(hook.received) >= 2  # tried: a 500, then a retry that hung
    assert losses(bad) == losses(ok)
    # an alert sent from the training thread would cost at least one POST timeout (5 s); close() waits
    # 0.5 s at most; the rest is run-to-run noise of two ~4 s runs
    assert bad_time < ok_time + POST_TIMEOUT_S / 2, (bad_time, ok_time)


def test_the_webhook_url_is_in_no_file_of_the_run(endpoints):
    for run, _, _ in endpoints.values():
        for path in [p for p in run.rglob("*") if p.is_file()]:
            assert SECRET.encode() not in path.read_bytes(), path
        assert "/***" in (run / "config.toml").read_text()


def test_the_loss_forecast_follows_a_power_law():
    points = [(s, 2.0 + 3.0 * s**-0.5) for s in range(10, 400, 10)]
    assert forecast_loss(points, 1000) == pytest.approx(2.0 + 3.0 * 1000**-0.5, abs=0.01)
