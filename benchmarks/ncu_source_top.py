"""The SASS lines of one Nsight Compute report with the most warp-stall samples, and the samples
by opcode: ``python benchmarks/ncu_source_top.py REPORT.ncu-rep [--top 40]`` (reads ``ncu
--import REPORT --page source --csv --print-source sass``; the report needs the SourceCounters
section)."""

import argparse
import collections
import csv
import io
import subprocess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=40)
    opts = ap.parse_args()
    text = subprocess.run(["ncu", "--import", opts.report, "--page", "source", "--csv",
                           "--print-source", "sass"], capture_output=True, text=True).stdout
    rows = list(csv.reader(io.StringIO(text)))
    at = next(i for i, r in enumerate(rows) if any("Sampling (All" in c for c in r))
    head, body = rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]
    col = next(i for i, h in enumerate(head) if "Sampling (All" in h)
    src = next((i for i, h in enumerate(head) if h.strip().lower() == "source"), 1)
    print("columns:", head)

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[col]) for r in body) or 1.0
    by_op = collections.Counter()
    for r in body:
        by_op[(r[src].split() or ["?"])[0].split(".")[0]] += num(r[col])
    print(f"samples: {total:.0f}; by opcode:",
          ", ".join(f"{k} {v / total:.1%}" for k, v in by_op.most_common(14)))
    for r in sorted(body, key=lambda r: -num(r[col]))[:opts.top]:
        print(f"{num(r[col]) / total:6.1%}  {r[0]:>6}  {r[src][:100]}")


if __name__ == "__main__":
    main()
