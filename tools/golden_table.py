"""Summarise build/golden_report.json (written by the test run): per case and component,
how many golden comparisons passed, how many were exact, and the bf16-identical fraction."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

REPORT = Path(__file__).resolve().parents[1] / "build" / "golden_report.json"


def main() -> int:
    rows = json.loads(REPORT.read_text())
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for row in rows:
        array = row["array"].split(".")[-1] if "." in row["array"] else row["array"]
        groups[(row["case"], row["component"], array)].append(row)
    print("| case | component | array | checks | passed | exact | bf16-identical min | mean |")
    print("|---|---|---|---|---|---|---|---|")
    for (case, component, array), items in sorted(groups.items()):
        bits = [r["bit_identical"] for r in items]
        print(f"| {case} | {component} | {array} | {len(items)} | "
              f"{sum(r['ok'] for r in items)} | {sum(r['exact'] for r in items)} | "
              f"{min(bits):.4f} | {sum(bits) / len(bits):.4f} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
