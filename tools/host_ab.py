"""Host time per eager call of two source trees, interleaved on one GPU (world size 1), R1-decode shapes.

    python tools/host_ab.py --base DIR [--rounds 3] [--json ws1-host-time.json]

DIR is another checkout of moecomm (the call path before a change, say); this tree is the other. Each round
runs ``python -m moecomm.bench --configs r1-decode --no-graph`` once per tree, alternating, and the JSON keeps
every round's medians (DeviceBuffer, CuPy and torch inputs; dispatch and combine) and the best of each: this
VM's eager figures move by tens of percent between runs, so only interleaved rounds compare.
"""
import argparse
import json
import os
import platform
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other source tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json", default="ws1-host-time.json")
    args = p.parse_args()
    trees = {"base": Path(args.base).resolve(), "this": HERE}
    runs = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(host_times(tree, args.iters))
    best = {name: {kind: {phase: min(r[kind][phase] for r in rs) for phase in rs[0][kind]} for kind in rs[0]}
            for name, rs in runs.items()}
    doc = {"command": "python tools/host_ab.py " + " ".join(sys.argv[1:]), "host": platform.node(),
           "python": platform.python_version(), "trees": {k: str(v) for k, v in trees.items()}, "rounds": runs,
           "best": best}
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"{'host us per call (best of rounds)':<34} {'base d/c':>14} {'this d/c':>14}")
    for kind in best["this"]:
        b, t = best["base"][kind], best["this"][kind]
        print(f"{kind:<34} {b['dispatch']:>6.1f}/{b['combine']:<7.1f} {t['dispatch']:>6.1f}/{t['combine']:<7.1f}")


if __name__ == "__main__":
    main()
