"""Host time per eager call of two source trees, interleaved on one GPU (world size 1), R1-decode shapes.

    python tools/host_ab.py --base DIR [--rounds 3] [--json ws1-host-time.json]

DIR is another checkout of moecomm (the call path before a change, say); this tree is the other. Each round
runs ``python -m moecomm.bench --configs r1-decode --no-graph`` once per tree (which goes first alternates
between rounds), and the JSON keeps every round's medians (DeviceBuffer, CuPy and torch inputs; dispatch,
combine), the best of each, and the median over rounds of this tree's difference from the base within a round:
this VM's eager figures move by tens of percent between runs, so only interleaved rounds compare, and the
paired difference is the steadier figure where a whole round runs slow.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def host_times(tree, iters):
    """{kind: {phase: median us}} of one benchmark run from ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        transport = os.environ.get("MOECOMM_TRANSPORT", "ipc")
        subprocess.run([sys.executable, "-m", "moecomm.bench", "--transport", transport, "--configs", "r1-decode",
                        "--iters", str(iters), "--no-graph", "--json", str(out),
                        "--plot", str(Path(tmp) / "x.png")], check=True, env=env, cwd=tmp, capture_output=True)
        result = json.loads(out.read_text())["results"][0]["host_us"]
    return {kind: {phase: round(v["median_us"], 2) for phase, v in phases.items()} for kind, phases in result.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other source tree")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the trees in turn (default 3)")
    p.add_argument("--iters", type=int, default=300, help="timed calls per tree and round (default 300)")
    p.add_argument("--json", default="ws1-host-time.json", help="output JSON (default ws1-host-time.json)")
    args = p.parse_args()
    trees = {"base": Path(args.base).resolve(), "this": HERE}
    runs = {name: [] for name in trees}
    for i in range(args.rounds):
        for name in (trees if i % 2 == 0 else reversed(trees)):
            runs[name].append(host_times(trees[name], args.iters))
    kinds = runs["this"][0]
    best = {name: {kind: {phase: min(r[kind][phase] for r in rs) for phase in rs[0][kind]} for kind in rs[0]}
            for name, rs in runs.items()}
    paired = {kind: {phase: round(statistics.median(t[kind][phase] - b[kind][phase]
                                                    for b, t in zip(runs["base"], runs["this"])), 2)
                     for phase in kinds[kind] if phase in runs["base"][0][kind]} for kind in kinds}
    doc = {"command": "python tools/host_ab.py " + " ".join(sys.argv[1:]), "host": platform.node(),
           "python": platform.python_version(), "trees": {k: str(v) for k, v in trees.items()}, "rounds": runs,
           "best": best, "median_difference_this_minus_base": paired}
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"{'host us per call':<12} {'base best d/c':>15} {'this best d/c':>15} {'this - base, median d/c':>25}")
    for kind in kinds:
        b, t, d = best["base"][kind], best["this"][kind], paired[kind]
        print(f"{kind:<12} {b['dispatch']:>7.1f}/{b['combine']:<7.1f} {t['dispatch']:>7.1f}/{t['combine']:<7.1f} "
              f"{d['dispatch']:>+12.2f}/{d['combine']:<+12.2f}")


if __name__ == "__main__":
    main()
