"""`ansible-playbook recover.yml --check` is the assessment: it reports and changes nothing."""

from __future__ import annotations

from labctl import lab_ssh, playbook


def test_check_mode_assesses_and_changes_nothing(lab_hosts):
    host = lab_hosts[0]
    planted = playbook("tests/plays/plant_units.yml")
    assert planted.rc == 0, planted.output[-3000:]

    run = playbook("recover.yml", "--check", "--diff")

    assert run.rc == 0, run.output[-3000:]
    assert run.recap()[host]["failed"] == 0
    report = run.output[run.output.index("units_running"):]
    assert "vllm-kimi-k25-int4.service" in report.split("\n", 3)[1], report[:400]
    assert "fstype: ext4" in run.output
    # --check reports what it would change (changed > 0) but the host is exactly as it was:
    still = lab_ssh(host, "systemctl is-active vllm-kimi-k25-int4.service node-telemetry.service; "
                          "systemctl is-enabled vllm-kimi-k25-int4.service; ls /opt/hsx /etc/hsx 2>&1 | head -2")
    assert still.stdout.split()[:3] == ["active", "active", "enabled"], still.stdout
    assert "No such file or directory" in still.stdout, still.stdout
