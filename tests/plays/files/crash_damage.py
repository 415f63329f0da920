"""Damage a finished extraction output the way a killed node leaves it (lab hosts, test only).

Two shards truncated (written without fsync when the VM died), one with flipped bytes in its
tensor data, two orphan temp files an hour old, and status.json saying "running" for a process
that no longer exists, with the run's real total. Deterministic: the victims are the first index
entries by sample id. Prints what it did as JSON.
"""

import json
import os
import sys
import time

out, total = sys.argv[1], int(sys.argv[2])
entries = []
with open(os.path.join(out, "index.jsonl"), "rb") as f:
    for line in f:
        entries.append(json.loads(line.rsplit(b"\t", 1)[0]))
entries.sort(key=lambda e: e["id"])
truncated, corrupt = entries[:2], entries[2]
for e in truncated:
    path = os.path.join(out, e["path"])
    with open(path, "r+b") as f:
        f.truncate(e["size"] // 3)
path = os.path.join(out, corrupt["path"])
with open(path, "r+b") as f:
    f.seek(corrupt["size"] // 2)
    chunk = f.read(64)
    f.seek(corrupt["size"] // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))
orphans = []
shard_dir = os.path.dirname(os.path.join(out, entries[3]["path"]))
for n in range(2):
    name = os.path.join(shard_dir, f".crashed-{n}.pt.4242.ab{n}cd.tmp")
    with open(name, "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 1000)
    old = time.time() - 3600
    os.utime(name, (old, old))
    orphans.append(name)
status_path = os.path.join(out, "status.json")
with open(status_path) as f:
    status = json.load(f)
status.update(state="running", total=total, pid=4_000_000, message="", eta_s=None)
with open(status_path, "w") as f:
    json.dump(status, f)
print(json.dumps({"truncated": [e["id"] for e in truncated], "corrupt": corrupt["id"], "orphans": orphans,
                  "indexed": len(entries), "total": total}))
