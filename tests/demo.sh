#!/usr/bin/env bash
# `make demo`: the main job on the embedded default (the lab). Boots a real lab host, plants the
# incident (an auto-started fake vLLM unit, a half-finished extraction with truncated and corrupt
# shards and orphan temp files, nothing deployed) on an sglang-backend node (a real, unpatched SGLang
# release's files; the TEST-ONLY stand-in server in place of a real one, which needs a GPU), shows
# the assessment (--check), runs the recovery - patch and server stages included - and prints the
# report.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" ANSIBLE_FORCE_COLOR=0 HF_HUB_OFFLINE=1
start=$(date +%s)
sglang=(-e @tests/plays/files/demo_sglang.yml)  # the node's backend: sglang (see that file)
echo "== booting 1 lab host"
.venv/bin/python tests/lab/lab.py up 1 --data-size 1G
echo "== planting the incident (first time: builds the tiny model and the half-finished run, ~1-2 min)"
ansible-playbook tests/plays/plant_incident.yml "${sglang[@]}" >/tmp/hsx-demo-plant.log 2>&1 || { tail -40 /tmp/hsx-demo-plant.log; exit 1; }
echo "== planting SGLang $(sed -n 's/^hsx_lab_sglang_release: "\(.*\)"/\1/p' tests/plays/files/demo_sglang.yml), unpatched (the real release's files), and the TEST-ONLY stand-in server that runs in its place: a real SGLang server needs a GPU"
ansible-playbook tests/plays/plant_sglang.yml "${sglang[@]}" >>/tmp/hsx-demo-plant.log 2>&1 || { tail -40 /tmp/hsx-demo-plant.log; exit 1; }
echo "== ansible-playbook recover.yml --check --diff   (the assessment: changes nothing)"
ansible-playbook recover.yml "${sglang[@]}" --check --diff >/tmp/hsx-demo-check.log 2>&1 || true
sed -n '/Print the assessment/,/^$/p' /tmp/hsx-demo-check.log | head -40
echo "== ansible-playbook recover.yml   (the recovery)"
crash=$(date +%s)
if ansible-playbook recover.yml "${sglang[@]}" >/tmp/hsx-demo-recover.log 2>&1; then rc=0; else rc=$?; fi
report=$(ls -d reports/*/ | sort | tail -1)
cat "$report/summary.md"
echo "== (the 'server' above is the TEST-ONLY stand-in, tests/standin_sglang/server.py, running the patch and hook the 'patch' stage put into the planted SGLang)"
echo "== crash to 'extraction making progress': $(( $(date +%s) - crash ))s (whole demo $(( $(date +%s) - start ))s); play exit code $rc"
echo "== full log: /tmp/hsx-demo-recover.log; the host is still up: '.venv/bin/python tests/lab/lab.py ssh HOST CMD' (status lists them); 'make lab-down' removes it"
exit $rc
