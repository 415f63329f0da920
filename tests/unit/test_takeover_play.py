"""Issue #39 item 3: playbooks/takeover.yml's plan, on local stand-in hosts (the lab test,
tests/integration/test_fleet.py, runs the whole takeover on real hosts).

n1 and n2 run over the local connection; n3 points at a closed local port (unreachable, as a dead
node is). The plan reads finished buckets from each host's own output: n1's output has finished
some of ITS buckets (ignored: only the taken host's count), and a reachable n2 taken over keeps
what its output finished. --check prints the plan and writes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hsx.bucketcount import count_totals, write_bucket_totals
from hsx.buckets import bucket_of
from hsx.index import encode_index_line

ROOT = Path(__file__).resolve().parents[2]
IDS = [f"s{i}" for i in range(40)]


def plant_output(out: Path, spec: str, done: list[str]) -> None:
    """An output of a 6-bucket run: run.json, buckets.json (every bucket's samples), an index of `done`."""
    out.mkdir(parents=True)
    (out / "run.json").write_text('{"buckets": 6}')
    write_bucket_totals(str(out), 6, spec, count_totals(IDS, 6))
    with open(out / "index.jsonl", "wb") as f:
        for i in done:
            f.write(encode_index_line({"id": i, "path": f"shards/00/{i}.pt", "size": 1, "checksum": "crc32:00000000",
                                       "num_tokens": 1}))


def flat(out: str) -> str:
    """ansible's YAML output, one line, its quoted quotes ('') as one."""
    return " ".join(out.split()).replace("''", "'")


def takeover(tmp: Path, dead: str, *args: str) -> subprocess.CompletedProcess:
    py = sys.executable
    local = {"ansible_connection": "local", "ansible_python_interpreter": py}
    hosts = {"n1": {**local, "hsx_output_dir": str(tmp / "n1")}, "n2": {**local, "hsx_output_dir": str(tmp / "n2")},
             "n3": {"ansible_host": "127.0.0.1", "ansible_port": 9, "ansible_python_interpreter": py}}
    inventory = {"extraction_nodes": {"hosts": hosts, "vars": {
        "hsx_assignment_file": str(tmp / "fleet.json"), "hsx_become": False, "hsx_model_path": "/m",
        "hsx_dataset_path": "/d.jsonl"}}}
    (tmp / "inventory.json").write_text(json.dumps(inventory))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_TIMEOUT="5")
    return subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(tmp / "inventory.json"),
                           "playbooks/takeover.yml", "-e", f"hsx_takeover_host={dead}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_plan_reads_finished_buckets_from_the_nodes_and_check_mode_writes_nothing(tmp_path) -> None:
    fleet = {"buckets": 6, "created": "x", "epoch": 0, "hosts": {"n1": "0-1", "n2": "2-3", "n3": "4-5"},
             "retired": [], "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    in_bucket = {b: [i for i in IDS if bucket_of(i, 6) == b] for b in range(6)}
    plant_output(tmp_path / "n1", "0-1", in_bucket[0])  # n1 finished its bucket 0
    plant_output(tmp_path / "n2", "2-3", in_bucket[2] + in_bucket[3][:1])  # n2: bucket 2 whole, 3 in part

    # n3 cannot be reached: nothing of it counts as finished, both its buckets move.
    check = takeover(tmp_path, "n3", "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert "Would move n3's unfinished buckets: n1 takes 4; n2 takes 5" in flat(check.stdout), \
        check.stdout[-3000:]
    assert json.loads((tmp_path / "fleet.json").read_text()) == fleet

    # n2 answers: it keeps bucket 2 (its output holds all of it), bucket 3 moves (partly done).
    check = takeover(tmp_path, "n2", "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert "Would move n2's unfinished buckets: n1 takes 3 (n2 keeps 2:" in flat(check.stdout), \
        check.stdout[-3000:]
    assert json.loads((tmp_path / "fleet.json").read_text()) == fleet


def test_a_host_whose_index_cannot_be_read_takes_nothing(tmp_path) -> None:
    """#39 review 5: n2 answers but its index is a link (never followed): which of its buckets are
    finished is unknown, so it is not a live host; n1 takes all of the unreachable n3's buckets."""
    fleet = {"buckets": 6, "created": "x", "epoch": 0, "hosts": {"n1": "0-1", "n2": "2-3", "n3": "4-5"},
             "retired": [], "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    plant_output(tmp_path / "n1", "0-1", [])
    plant_output(tmp_path / "n2", "2-3", [])
    (tmp_path / "n2" / "index.jsonl").rename(tmp_path / "n2" / "index.real")
    (tmp_path / "n2" / "index.jsonl").symlink_to(tmp_path / "n2" / "index.real")
    check = takeover(tmp_path, "n3", "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert "Would move n3's unfinished buckets: n1 takes 4-5 (n3 keeps nothing" in flat(check.stdout), \
        check.stdout[-3000:]


def test_an_unreachable_host_keeps_what_it_last_reported_finished_parked(tmp_path) -> None:
    """Issue #51 item 7: the record beside the file (finished.json: fleet-status read n3's output before
    it died) says n3 finished bucket 4: it stays parked on n3, only 5 moves; --disk-lost moves both."""
    fleet = {"buckets": 6, "created": "x", "epoch": 0, "hosts": {"n1": "0-1", "n2": "2-3", "n3": "4-5"},
             "retired": [], "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    (tmp_path / "finished.json").write_text(json.dumps({"version": 1, "buckets": 6, "hosts": {
        "n3": {"finished": "4", "at": "2026-12-07T10:00:00+00:00", "by": "fleet-status"}}}))
    plant_output(tmp_path / "n1", "0-1", [])
    plant_output(tmp_path / "n2", "2-3", [])
    check = takeover(tmp_path, "n3", "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert "Would move n3's unfinished buckets: n1 takes 5 (n3 keeps 4: parked, not answering" in flat(check.stdout), \
        check.stdout[-3000:]
    lost = takeover(tmp_path, "n3", "--check", "-e", "hsx_takeover_disk_lost=true")
    assert "Would move n3's unfinished buckets: n1 takes 4; n2 takes 5 (n3 keeps nothing" in flat(lost.stdout), \
        lost.stdout[-3000:]
    assert json.loads((tmp_path / "fleet.json").read_text()) == fleet
