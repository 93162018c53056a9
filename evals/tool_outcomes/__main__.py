"""python -m evals.tool_outcomes: print the figures of the old word check and the new verdict."""

from __future__ import annotations

import argparse
from pathlib import Path

from evals.tool_outcomes import LABELLED, load, report

parser = argparse.ArgumentParser(description="precision and recall of 'the tool failed' on the labelled set")
parser.add_argument("--file", type=Path, default=LABELLED, help="the labelled JSONL (gzip'd)")
print(report(load(parser.parse_args().file)))
