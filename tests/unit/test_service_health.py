"""library/service_health.py: the wait's verdicts on scripted unit states (fake clock), and real HTTP
probes of a real local server through the module's entry point."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

sh = load_module("service_health")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def scripted(answers, states=None, **kw):
    """A HealthWait whose probes and unit reads come from lists (the last item repeats)."""
    clock = Clock()
    answers, states = list(answers), list(states or [])

    def probe():
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def read_unit():
        return states.pop(0) if len(states) > 1 else states[0]

    return sh.HealthWait(probe, read_unit if states else None, clock=clock, sleep=clock.sleep, **kw), clock


def unit(active="active", sub="running", restarts=0, **extra):
    return {"LoadState": "loaded", "ActiveState": active, "SubState": sub, "NRestarts": str(restarts),
            "Result": extra.pop("result", "success"), "ExecMainStatus": "0", **extra}


def test_healthy_after_a_few_probes():
    wait, clock = scripted([(0, "refused"), (503, ""), (200, "")], [unit()], delay=5, timeout=60)
    result = wait.run()
    assert result["healthy"] and result["probes"] == 3 and clock.t == 10
    assert result["reason"] == "" and result["restarts"] == 0


def test_crash_loop_fails_long_before_the_timeout():
    states = [unit(), unit(restarts=0), unit("activating", "auto-restart", 1), unit("activating", "start", 2)]
    wait, clock = scripted([(0, "refused")], states, delay=5, timeout=1800, max_restarts=1)
    result = wait.run()
    assert not result["healthy"] and result["reason"] == "crash loop", result
    assert result["restarts"] == 2 and clock.t == 10 and "restarted the unit 2 times" in result["message"]


def test_one_restart_is_tolerated_by_default():
    states = [unit(restarts=3), unit("activating", "auto-restart", 4), unit(restarts=4)]
    wait, _ = scripted([(0, "refused"), (0, "refused"), (200, "")], states, delay=1, timeout=60)
    result = wait.run()
    assert result["healthy"] and result["restarts"] == 1  # counted from the value when the wait began


@pytest.mark.parametrize(("state", "reason"), [
    (unit("failed", "failed", result="exit-code"), "unit failed"),
    (unit("inactive", "dead"), "unit stopped"),
    ({"LoadState": "not-found", "ActiveState": "inactive"}, "unit not loaded"),
])
def test_a_dead_unit_ends_the_wait_at_once(state, reason):
    wait, clock = scripted([(0, "refused")], [unit(), state], delay=5, timeout=600)
    result = wait.run()
    assert result["reason"] == reason and result["probes"] == 1 and clock.t == 0, result


def test_timeout_names_the_last_probe():
    wait, clock = scripted([(503, "")], [unit("activating", "start")], delay=4, timeout=10)
    result = wait.run()
    assert result["reason"] == "timeout" and clock.t == 10 and result["probes"] == 4
    assert "no 200 within 10 s (last probe: HTTP 503)" in result["message"]


def test_without_a_unit_only_the_url_counts():
    wait, _ = scripted([(0, "refused")], None, delay=1, timeout=3)
    result = wait.run()
    assert result["reason"] == "timeout" and result["restarts"] is None and result["unit_state"] == {}


@pytest.fixture
def server():
    codes = {"/health": 200, "/busy": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(codes.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def run_module(capsys, **args):
    with patch_module_args(args), pytest.raises(SystemExit):
        sh.main()
    return json.loads(capsys.readouterr().out)


def test_module_against_a_real_server(server, capsys):
    out = run_module(capsys, url=f"{server}/health", timeout=5, delay=0.1)
    assert out["healthy"] and out["status"] == 200 and not out["changed"] and "failed" not in out

    out = run_module(capsys, url=f"{server}/busy", timeout=1, delay=0.2)
    assert out["failed"] and out["status"] == 503 and out["reason"] == "timeout"
    assert out["msg"].startswith(f"{server}/busy is not healthy: no 200 within 1 s (last probe: HTTP 503)")


def test_module_nobody_listening(capsys):
    out = run_module(capsys, url="http://127.0.0.1:9/health", timeout=0, delay=1, request_timeout=2)
    assert out["failed"] and out["status"] == 0 and out["error"] and out["probes"] == 1


def test_module_rejects_bad_settings(capsys):
    out = run_module(capsys, url="http://127.0.0.1:9/", delay=0)
    assert out["failed"] and "delay and request_timeout > 0" in out["msg"] and "probes" not in out
