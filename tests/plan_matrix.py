"""The CI matrix of memory plans (nox session `plan(hardware=...)`): plan every example in examples/ whose
memory.plan.hardware is the given profile, and fail when one does not fit or drifts from its recorded plan in
examples/plans/<name>.<hardware>.json. Pure Python (miles-memory alone, no torch work).

    python tests/plan_matrix.py --hardware h100            # check
    python tests/plan_matrix.py --hardware h100 --record   # re-record after an intended change
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from miles_memory import plan_memory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RECORDS = EXAMPLES / "plans"


def examples_for(hardware: str) -> list[Path]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        if ((config.get("memory") or {}).get("plan") or {}).get("hardware") == hardware:
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--record", action="store_true", help="Write the plans as the new records")
    args = parser.parse_args(argv)
    paths = examples_for(args.hardware)
    if not paths:
        print(f"no example in examples/ plans for hardware {args.hardware!r}", file=sys.stderr)
        return 1
    failures = []
    for path in paths:
        plan = plan_memory(path)
        record = RECORDS / f"{path.stem}.{args.hardware}.json"
        text = json.dumps(plan.model_dump(mode="json"), indent=2) + "\n"
        print(plan.summary())
        if not plan.fits:
            failures.append(f"{path.name} does not fit {args.hardware}: {plan.summary()}")
        if args.record:
            record.write_text(text)
        elif not record.is_file():
            failures.append(f"{path.name}: no recorded plan {record.relative_to(ROOT)}")
        elif json.loads(record.read_text()) != json.loads(text):
            old = json.loads(record.read_text())
            changed = sorted(k for k in old.keys() | plan.model_dump(mode="json").keys()
                             if old.get(k) != plan.model_dump(mode="json").get(k))  # fmt: skip
            failures.append(f"{path.name}: the plan drifted from {record.relative_to(ROOT)} (changed: {changed})")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if failures and not args.record:
        print(
            f"re-record after an intended change: uv run python tests/plan_matrix.py --hardware {args.hardware} "
            "--record",
            file=sys.stderr,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
