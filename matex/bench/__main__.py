"""python -m matex.bench RECIPE [--seeds 3] [--ranks 1,2] [--variants plain,pruning] [--out DIR]

Runs a named training (``shapes``, ``mnist_cnn``) for every variant, rank
count and seed, one ``mpiexec`` job each, and writes every run, the median
and min/max per variant and rank count (runs.csv, summary.csv, report.md)
and a plot (report.png) under ``--out``. See ``matex.science.recipe``.
"""

import argparse
import sys


def _ints(text):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, got %r" % text)


def main(argv=None) -> int:
    from matex.science._recipes import RECIPES, VARIANTS

    parser = argparse.ArgumentParser(prog="python -m matex.bench", description=__doc__.split(
        "\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--ranks", type=_ints, default=[1, 2], help="rank counts, e.g. 1,2")
    parser.add_argument("--variants", default="plain",
                        help="comma-separated, of: %s (default plain)" % ", ".join(VARIANTS))
    parser.add_argument("--apoptosis", action="store_true", help="add the apoptosis variant")
    parser.add_argument("--pruning", action="store_true", help="add the pruning variant")
    parser.add_argument("--out", default="matex-bench", help="output directory")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--samples", type=int, help="training samples")
    parser.add_argument("--batch-size", type=int, help="global batch")
    parser.add_argument("--target", type=float, help="target test accuracy")
    parser.add_argument("--threshold", type=float, default=0.1, help="apoptosis threshold")
    parser.add_argument("--margin", type=float, default=2.0, help="pruning margin")
    parser.add_argument("--full-pass-every", type=int, default=3, help="pruning full pass")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for flag in ("apoptosis", "pruning"):
        if getattr(args, flag) and flag not in variants:
            variants.append(flag)
    from matex.science._recipes import recipe

    try:
        recipe(args.recipe, seeds=args.seeds, ranks=args.ranks, variants=variants, out=args.out,
               epochs=args.epochs, samples=args.samples, batch_size=args.batch_size,
               target=args.target, threshold=args.threshold, margin=args.margin,
               full_pass_every=args.full_pass_every)
    except (ValueError, RuntimeError) as exc:
        print("matex.bench: %s" % exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
