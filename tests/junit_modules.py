#!/usr/bin/env python3
"""Seconds per test module from a pytest JUnit file (setup, call and teardown together), the
slowest first: where a stage's time goes (tests/stages.py prints it for each unit shard).

    junit_modules.py FILE.xml [--top N]
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET


def module_seconds(path: str) -> collections.Counter[str]:
    """{test module (dotted, as JUnit's classname has it): seconds}."""
    totals: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        parts = case.get("classname", "?").split(".")
        module = ".".join(p for p in parts if not p[:1].isupper())  # drop a test class
        totals[module] += float(case.get("time") or 0)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    try:
        totals = module_seconds(args.junit)
    except (OSError, ET.ParseError) as e:
        print(f"junit_modules: cannot read {args.junit}: {e}", file=sys.stderr)
        return 1
    print(f"=== time per test module ({sum(totals.values()):.0f} s in all, the {args.top} slowest):")
    for module, seconds in totals.most_common(args.top):
        print(f"{seconds:8.1f} s  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
