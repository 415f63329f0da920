"""Self-healing's brakes and checks, on the control node (`hsx selfheal`; README, "Self-healing").

policy: when the loop may act and when it holds for a person (circuit breaker, flapping, failures in a row).
ledger: what it was asked, found and did, and its brakes, in the operator's state directory.
verify: an alert's claim checked before acting (extensions/eda/playbooks/selfheal_verify.yml).
remedy: one automatic remedy end to end: record, settle, verify, decide, act, record.
promtext: the loop's state as Prometheus text (hsx-selfheal.prom) for the alerts that ask a person.
"""
