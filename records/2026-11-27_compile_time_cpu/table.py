"""The README's table from runs.jsonl (run.sh's output): per version, model and start, the
compile time of each training step that compiled, their sum, the graphs, and the median time
of the steps that compiled nothing.

    python table.py [runs.jsonl]     # default: the one beside this file
"""

import argparse
import json
import os
import statistics


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="?", default=os.path.join(os.path.dirname(__file__), "runs.jsonl"))
    args = p.parse_args()
    print("| version | model | start | compile s per step | compile s | graphs | step s |")
    print("|---|---|---|---|---|---|---|")
    with open(args.runs) as f:
        for line in f:
            r = json.loads(line)
            steps = r["run"]["steps"]
            compiled = [s["compile_s"] for s in steps if s["compile_s"] > 0]
            rest = statistics.median(s["wall_s"] for s in steps if s["compile_s"] == 0)
            print(
                f"| {r['version']} | {'compacted' if r['run']['compact'] else 'masked'} "
                f"| {r['start']} | {', '.join(f'{c:.1f}' for c in compiled)} "
                f"| {sum(compiled):.1f} | {r['run']['graphs']} | {rest:.2f} |"
            )


if __name__ == "__main__":
    main()
