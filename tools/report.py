"""Draw the report PNG of a run folder: python tools/report.py RUN_DIR [--out report.png]"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazoo.training.monitor.report import write_report  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", help="the --save (or --tensorboard-dir) folder of a run")
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        print(write_report(a.run_dir, a.out))
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
