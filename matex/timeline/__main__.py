"""``python -m matex.timeline merge DIR``: merge the ranks' timelines into DIR/merged.json."""

import argparse
import sys

from matex.timeline._merge import merge
from matex.timeline._writer import TimelineError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matex.timeline",
                                     description="Tools for MaTEx timelines.")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge DIR/timeline-rank*.json into DIR/merged.json "
                                     "(one process row per rank)")
    m.add_argument("directory")
    m.add_argument("-o", "--output", help="where to write (default DIR/merged.json)")
    args = parser.parse_args(argv)
    try:
        path, ranks, events = merge(args.directory, args.output)
    except TimelineError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("merged %d ranks (%d events) into %s; open it in https://ui.perfetto.dev or "
          "chrome://tracing" % (len(ranks), events, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
