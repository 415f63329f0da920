"""The operator's front door over ansible-runner: `hsx recover|takeover|provision|rollout-patch|fleet-status`.

collection: where the playbooks and modules come from - the checkout, else the installed hsx.recovery.
events: runner events -> per-host progress and its live or line-by-line display.
playbook: run one of our playbooks through ansible-runner (artifacts bounded, no secrets kept).
fleetstatus: one ad-hoc `extraction_status_info` run over the fleet -> rows, marks, fleet total.
plot: samples done over time from status.json histories, as a PNG.
report: a recovery's dumped facts -> per-host JSON and summary.md (`hsx report`, recover.yml).
"""
