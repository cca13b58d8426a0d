"""Draw the report PNG of a run folder: python tools/report.py RUN_DIR [--out report.png]"""
import argparse
import sys

from megazoo.training.monitor.report import write_report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", help="the --save (or --tensorboard-dir) folder of a run")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        print(write_report(a.run_dir, a.out))
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
