"""Run a GPU probe as pieces, each in its own child process with a timeout, so a kernel that
deadlocks or kills its process costs only its piece. Shared by the varlen probes.

    main_with_pieces(__file__, "varlen_probe", PIECES, TOTAL_BUDGET_S, run_piece, summary_table)

The script is started once without ``--piece``: it runs each wanted piece as
``script --piece NAME --out DIR`` (which calls ``run_piece(name, out_dir)`` and writes
``{prefix}_{name}.json``), skips what no longer fits the budget, and writes
``gluon_{prefix}.json`` with every piece's result and ``summary_table(report)`` printed last.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback


def log(*a):
    print(*a, flush=True)


def run_script(script: str, args: list, timeout: float, label: str = "piece"):
    """Run ``python script *args`` in a child process with the repository on PYTHONPATH; its
    return code, or "timeout" when it ran past ``timeout`` seconds (deadlocked or too slow)."""
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log(f"== {label} {' '.join(args)} (timeout {timeout:.0f}s)")
    try:
        return subprocess.run([sys.executable, os.path.abspath(script), *args], timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        log(f"!! {label} {' '.join(args)} TIMED OUT after {timeout:.0f}s (deadlock or too slow)")
        return "timeout"


def load_json(path: str):
    """The JSON a child wrote, or None when it wrote none (crashed, timed out)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _run_one(run_piece, name: str, out_dir: str, prefix: str) -> None:
    started = time.time()
    try:
        res = run_piece(name, out_dir)
        res["status"] = "ok" if res.get("ok") else "FAILED"
    except Exception as e:  # recorded for the parent, which reports it
        traceback.print_exc()
        res = {"status": "ERROR", "error": f"{type(e).__name__}: {e}"[:2000]}
    res["seconds"] = time.time() - started
    with open(os.path.join(out_dir, f"{prefix}_{name}.json"), "w") as f:
        json.dump(res, f, indent=1)


def _run_all(script: str, prefix: str, pieces, budget_s: float, wanted, out_dir: str, summary_table) -> None:
    t0 = time.time()
    report = {"pieces": {}}
    report_path = os.path.join(out_dir, f"gluon_{prefix}.json")
    for name, timeout in pieces:
        if name not in wanted:
            continue
        left = budget_s - (time.time() - t0)
        if left < 20:
            log(f"== {name}: skipped (time budget)")
            report["pieces"][name] = {"status": "skipped"}
            continue
        limit = min(timeout, left)
        log(f"== {name} (timeout {limit:.0f}s, {time.time() - t0:.0f}s elapsed)")
        started = time.time()
        path = os.path.join(out_dir, f"{prefix}_{name}.json")
        if os.path.exists(path):
            os.remove(path)
        rc = run_script(script, ["--piece", name, "--out", out_dir], limit)
        if rc == "timeout":
            report["pieces"][name] = {"status": "TIMEOUT"}
        else:
            report["pieces"][name] = load_json(path) or {"status": "CRASHED"}
        report["pieces"][name]["seconds"] = time.time() - started
        with open(report_path, "w") as f:
            json.dump(report, f, indent=1)
    table = summary_table(report)
    report["summary"] = table
    report["seconds"] = time.time() - t0
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    log("\n" + table)
    log(f"done in {time.time() - t0:.0f}s")


def main_with_pieces(script: str, prefix: str, pieces, budget_s: float, run_piece, summary_table) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--piece", default=None, help="(internal) run one piece in this process")
    ap.add_argument("--pieces", default=",".join(n for n, _ in pieces))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the other probes, for their helpers
    if args.piece:
        _run_one(run_piece, args.piece, args.out, prefix)
    else:
        _run_all(script, prefix, pieces, budget_s, args.pieces.split(","), args.out, summary_table)
