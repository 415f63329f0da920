#!/usr/bin/env bash
# `make demo`: the main job on the embedded default (the lab). Boots a real lab host, plants a
# crashed-looking node (an auto-started fake vLLM unit holding the node), and runs the recovery.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" ANSIBLE_FORCE_COLOR=0
echo "== booting 1 lab host"
.venv/bin/python tests/lab/lab.py up 1
echo "== planting the incident"
ansible-playbook tests/plays/plant_units.yml >/dev/null
echo "== ansible-playbook recover.yml --check --diff (the assessment; changes nothing)"
ansible-playbook recover.yml --check --diff | sed -n '/Print the assessment/,$p'
echo "== the lab host is still up: 'tests/lab/lab.py ssh hsxlab-1 CMD' to look; 'make lab-down' to remove it"
