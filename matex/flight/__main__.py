"""``python -m matex.flight DIR``: where did the ranks of a run diverge or stop?"""

import argparse
import sys

from matex.flight import FlightError, analyse, load


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m matex.flight",
        description="Read the flight-recorder dumps of every rank (DIR/rank<N>.json) and print "
                    "the first collective where the ranks diverge, or the rank that stopped "
                    "first.")
    parser.add_argument("directory", help="the MATEX_FLIGHT_DIR of the run (default of the "
                                          "run: ./matex-flight)")
    args = parser.parse_args(argv)
    try:
        finding = analyse(load(args.directory))
    except FlightError as exc:
        print("matex.flight: %s" % exc, file=sys.stderr)
        return 2
    print(finding.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
