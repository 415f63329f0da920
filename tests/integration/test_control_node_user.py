"""Issue #39 item 5: recover.yml and provision.yml from a normal account on the control node, sudo on the targets only.

An unprivileged local account (no sudo here) with its own copy of the checkout runs the assessment
(`recover.yml --check` and `playbooks/provision.yml --check`, the stages that build nothing) against one lab host. Everything the run
does on the control node (the target check, the report, ansible's own files) runs as that account:
the run succeeds, and nothing under its home (the checkout copy included) is owned by root. Before
the plays' localhost tasks set `become: false`, the report's tasks asked for sudo here and failed.
The account and the run: tests/control_node_account.py; rollout_patch.yml's run as that account is
in test_rollout.py (it needs that module's 4 hosts with SGLang planted and provisioned).
"""

from __future__ import annotations

import pytest
from control_node_account import owned_by_root, run_as_operator

# The stages that build nothing (the wheelhouse build would need the root account's package caches):
# what runs on the control node (the target check, the report, ansible's own files) is the same in
# every stage.
PLAYBOOKS = {
    "recover.yml": "deploy,patch,server,job",
    "playbooks/provision.yml": "deploy,patch,server,job,monitoring",
}


@pytest.mark.parametrize("play", sorted(PLAYBOOKS))
def test_a_play_checked_as_a_normal_user_leaves_nothing_owned_by_root(lab_hosts, operator, play):
    account, home = operator
    proc = run_as_operator(account, home, play, "--check", "--skip-tags", PLAYBOOKS[play])
    out = proc.stdout + proc.stderr

    assert proc.returncode == 0, out[-4000:]
    assert f"{lab_hosts[0]}" in out and "failed=0" in out.split("PLAY RECAP")[-1], out[-3000:]
    (summary,) = (home / "hsx" / "reports").glob("*/summary.md")
    assert summary.stat().st_uid == account.pw_uid
    owned = owned_by_root(home)
    assert not owned, owned[:20]
