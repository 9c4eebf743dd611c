"""Record DeepSpeed's per-step losses for every case (or those named) into deepspeed_losses.json.

    python tests/deepspeed_examples/record.py --python /work/dsenv/bin/python [case ...]

`--python`: an interpreter that has DeepSpeed 0.19 (a venv made with --system-site-packages, so that it shares
torch and transformers with the tests; see README.md). Each case runs with DS_ACCELERATOR=cpu, as harness.py says.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def versions(python: str) -> dict:
    code = ("import json, deepspeed, torch, transformers; print(json.dumps({'deepspeed': deepspeed.__version__, "
            "'torch': torch.__version__, 'transformers': transformers.__version__}))")
    out = subprocess.run([python, "-c", code], env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="an interpreter with deepspeed installed")
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(harness.CASES)}")
    args = parser.parse_args()
    found = versions(args.python)
    fixture = {}
    if os.path.exists(harness.FIXTURE):
        with open(harness.FIXTURE) as f:
            fixture = json.load(f)
    for name in args.cases or harness.CASES:
        case = harness.CASES[name]
        with tempfile.TemporaryDirectory(prefix=f"record_{name}_") as tmp:
            print(f"recording {name} ...", flush=True)
            result = harness.run_case(name, "deepspeed", tmp, python=args.python)
        entry = {"script": case["script"], "args": harness.deepspeed_args(case), "world": case["world"]}
        if case["world"] > 1:
            entry["launcher_args"] = harness.launcher_args(case["world"])
        for key in ("setup", "config"):
            if key in case:
                entry[key] = case[key]
        entry.update(result)
        if "resume" in case:
            entry["resume"] = {"args": case["resume"]["args"], **result["resume"]}
        entry.update(found)
        fixture[name] = entry
        print(f"  {json.dumps(result)}", flush=True)
        with open(harness.FIXTURE, "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
