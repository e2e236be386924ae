#!/usr/bin/env python3
"""Compares `attn-bench --json` files of several builds run alternately in one device call.

A change is measured against the build before it in the same call, builds alternated and each
run two or more times (A-1, B-1, A-2, B-2, ...), so that drift of the machine during the call
shows as a spread, not as a difference (BENCHMARKS.md, "Reproducing"). Each file is
named `<build>-<round>.json`: the build is the part of the name before the last `-`, so
`baseline-1.json` and `trial-2.json` work as well as `A-1.json`.

For every row (kernel and shape) the table gives each build's median time (the mean of its
rounds' medians, and their range), the first build's time over each other build's (above 1:
that build is faster) and, for the last build, TFLOP/s or the percentage of the read ceiling.
Rows match on kernel and shape, without the split plan's chunk, which a build may choose
differently.
The rounds' copy and read ceilings are printed first: a ceiling that moves between rounds by
more than the ratios do makes those ratios noise.

    python3 scripts/ab-compare.py out/A-1.json out/B-1.json out/A-2.json out/B-2.json
    python3 scripts/ab-compare.py out/            # every <build>-<round>.json in the folder
"""

import argparse
import json
import os
import re
import statistics
import sys


def build_of(path):
    name = os.path.basename(path)
    stem = name[: -len(".json")] if name.endswith(".json") else name
    build, sep, round_ = stem.rpartition("-")
    if not sep or not build or not round_:
        raise SystemExit(f"{path}: expected a name <build>-<round>.json")
    return build


def inputs(args):
    files = []
    for a in args:
        if os.path.isdir(a):
            files += sorted(os.path.join(a, f) for f in os.listdir(a) if f.endswith(".json") and "-" in f)
        elif os.path.isfile(a):
            files.append(a)
        else:
            raise SystemExit(f"{a}: no such file or folder")
    if not files:
        raise SystemExit("no attn-bench JSON files given")
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="<build>-<round>.json files, or folders of them")
    ap.add_argument("--base", help="the build the others are compared with (default: the first named)")
    ap.add_argument("--only", help="only rows whose kernel or shape contains this text")
    args = ap.parse_args()

    builds = []  # in the order first seen
    times = {}  # (kernel, shape) -> build -> [median_us]
    last_row = {}  # (kernel, shape) -> build -> row
    order = []  # rows in the order first seen
    for path in inputs(args.files):
        build = build_of(path)
        if build not in builds:
            builds.append(build)
        with open(path) as f:
            doc = json.load(f)
        copy, read = doc.get("copy_gbps"), doc.get("read_gbps")
        print(f"{os.path.basename(path)}: {doc.get('device', '?')}, copy {copy} GB/s, read {read} GB/s")
        for row in doc.get("rows", []):
            # The split plan's chunk is the build's choice, not part of the row.
            key = (row.get("kernel", ""), re.sub(r"\s*\(chunk \d+\)", "", row.get("shape", "")))
            if "ceiling" in key[0] or row.get("median_us") is None:
                continue
            if args.only and args.only not in key[0] and args.only not in key[1]:
                continue
            if key not in times:
                times[key] = {}
                order.append(key)
            times[key].setdefault(build, []).append(row["median_us"])
            last_row.setdefault(key, {})[build] = row

    base = args.base or builds[0]
    if base not in builds:
        raise SystemExit(f"--base {base}: no such build among {builds}")
    others = [b for b in builds if b != base]
    width = max([len(f"{k} {s}") for k, s in order] + [3])
    head = f"{'row':<{width}}" + "".join(f"{b + ' us':>22}" for b in [base] + others)
    head += "".join(f"{base + '/' + b:>12}" for b in others) + f"{'last build':>12}"
    print()
    print(head)
    for key in order:
        per = times[key]
        cells = []
        for b in [base] + others:
            xs = per.get(b)
            cells.append(f"{statistics.mean(xs):9.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-")
        ratios = []
        for b in others:
            if per.get(base) and per.get(b):
                ratios.append(f"{statistics.mean(per[base]) / statistics.mean(per[b]):12.3f}")
            else:
                ratios.append(f"{'-':>12}")
        last = last_row[key].get(builds[-1], {})
        if last.get("tflops"):
            rate = f"{last['tflops']:.1f} TF"
        elif last.get("pct_of_read"):
            rate = f"{last['pct_of_read']:.1f}% read"
        else:
            rate = ""
        print(f"{key[0] + ' ' + key[1]:<{width}}" + "".join(f"{c:>22}" for c in cells) + "".join(ratios) + f"{rate:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
