"""Write tests/file_seconds.json (each test file's seconds: setup + call + teardown of its tests)
from the output of a pytest run with ``--durations=0``, e.g.

    bash scripts/test.sh --durations=0 | tee /tmp/durations.log
    .venv/bin/python scripts/file_seconds.py /tmp/durations.log

The test session orders files by it, longest first (tests/conftest.py)."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?\.py)::")
OUT = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"


def file_seconds(lines) -> dict[str, float]:
    """Seconds per test file from ``--durations`` lines (other lines are ignored)."""
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        m = _LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(total.items(), key=lambda kv: -kv[1])}


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python scripts/file_seconds.py <pytest --durations=0 output>", file=sys.stderr)
        return 2
    try:
        seconds = file_seconds(Path(sys.argv[1]).read_text(errors="replace").splitlines())
    except OSError as exc:
        print(f"file_seconds: cannot read {sys.argv[1]}: {exc.strerror}", file=sys.stderr)
        return 2
    if not seconds:
        print(f"file_seconds: no --durations lines in {sys.argv[1]} (run pytest with --durations=0)", file=sys.stderr)
        return 2
    OUT.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s in all -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
