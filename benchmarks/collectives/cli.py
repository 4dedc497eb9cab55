"""The command line of `python -m benchmarks.collectives`: the subcommands' parsers
and the entry point."""

import argparse
import sys

from benchmarks.collectives.common import (
    DEFAULT_ITERS, GRADIENTS_ITERS, MIN_ITERS, PROG, SIZE_BUDGET_S, _nonnegative_int,
    _positive_int, add_launch_args, parse_size, relaunch, under_perseusrun)
from benchmarks.collectives.allreduce import (
    check_allreduce, run_allreduce)
from benchmarks.collectives.gradients import (
    check_gradients, run_gradients)

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Benchmarks of the Perseus-TF runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from perseus_tf._native import DTYPE_CODES  # noqa: WPS433 (needs the native build)
    ar = sub.add_parser(
        "allreduce",
        help="our allreduce path against raw Gloo allreduce, over tensor sizes",
        description="Times our allreduce path (submit + wait of one tensor) and a raw "
                    "contiguous Gloo allreduce on a dedicated context, interleaved, "
                    "for sizes doubling from --min-bytes to --max-bytes.")
    add_launch_args(ar)
    ar.add_argument("--min-bytes", type=parse_size, default=parse_size("4K"), metavar="SIZE",
                    help="smallest tensor size (default 4K)")
    ar.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"), metavar="SIZE",
                    help="largest tensor size (default 256M)")
    ar.add_argument("--iters", type=_positive_int, default=DEFAULT_ITERS, metavar="K",
                    help=f"timed iterations per size (default {DEFAULT_ITERS}); large sizes "
                         f"get fewer, down to {MIN_ITERS} (or K if smaller), to keep each "
                         f"size near --size-budget seconds")
    ar.add_argument("--warmup", type=_nonnegative_int, default=2, metavar="W",
                    help="untimed iterations of each path per size (default 2)")
    ar.add_argument("--size-budget", type=float, default=SIZE_BUDGET_S, metavar="S",
                    help=f"seconds each size should take, both paths together, when "
                         f"choosing its iteration count (default {SIZE_BUDGET_S:g})")
    ar.add_argument("--dtype", default="float32",
                    choices=[d for d in DTYPE_CODES if d not in ("bool", "bfloat16")],
                    help="element type (default float32)")
    place = ar.add_mutually_exclusive_group()
    place.add_argument("--in-place", dest="in_place", action="store_true", default=True,
                       help="(default) submit with output = input: what the TF kernel gets "
                            "when it can forward its input buffer, as it can for a step's "
                            "gradients, so the runtime has no input-to-output copy")
    place.add_argument("--separate-output", dest="in_place", action="store_false",
                       help="submit with a separate output array (what the TF kernel gets when "
                            "the input is still referenced elsewhere): adds one memcpy per call")
    ar.add_argument("--csv", default=None, metavar="PATH",
                    help="also write the table's rows to PATH (rank 0)")
    ar.set_defaults(run=run_allreduce, check=check_allreduce)

    gr = sub.add_parser(
        "gradients",
        help="one training step's gradients (a model profile) against raw Gloo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replays one training step's gradient communication: each rank fills "
                    "float32 arrays with values ~N(0, 1e-3) (seeded by rank) shaped like a "
                    "model's gradients, submits every one to the runtime in backprop "
                    "(reverse) order as an in-place average, and waits on them all (ours). "
                    "The baseline, run alternately in the same invocation, is one raw "
                    "contiguous Gloo allreduce of the same number of float32 elements (no "
                    "negotiation, no fusion, no per-tensor overhead).",
        epilog="Runtime options come from the environment, which perseusrun passes to every\n"
               "rank; set them on the command line, e.g.\n"
               "  PERSEUS_FUSION_THRESHOLD=16777216 PERSEUS_ALLREDUCE_STREAMS=2 \\\n"
               f"    {PROG} gradients --profile resnet50\n"
               "Useful ones: PERSEUS_FUSION_THRESHOLD (bytes per fused bucket),\n"
               "PERSEUS_ALLREDUCE_STREAMS, PERSEUS_CYCLE_TIME_MS, PERSEUS_ALLREDUCE_DTYPE\n"
               "(0 fp16, 1 none, 2 mixed), PERSEUS_OFFLINE_NEG. The header prints the values\n"
               "in use, and a result check says whether the reduction was exact fp32.")
    add_launch_args(gr)
    what = gr.add_mutually_exclusive_group(required=True)
    what.add_argument("--profile", metavar="NAME",
                      help="model whose gradients to replay: a NAME.json in --profile-dir "
                           "(resnet50, vgg16, bert_base)")
    what.add_argument("--tensors", type=_positive_int, metavar="N",
                      help="synthetic step instead of a profile: N tensors of --tensor-bytes")
    gr.add_argument("--tensor-bytes", type=parse_size, default=None, metavar="SIZE",
                    help="size of each synthetic tensor, a multiple of 4 bytes "
                         "(default 1K; only with --tensors)")
    gr.add_argument("--profile-dir", default=None, metavar="DIR",
                    help="folder of the profile JSON files (default: perseus_tf/profiles, "
                         "shipped with the package)")
    gr.add_argument("--iters", type=_positive_int, default=GRADIENTS_ITERS, metavar="K",
                    help=f"timed steps of each path (default {GRADIENTS_ITERS}); fewer, down "
                         f"to {MIN_ITERS} (or K if smaller), when a step is slow, to keep the "
                         f"run near --size-budget seconds")
    gr.add_argument("--warmup", type=_positive_int, default=2, metavar="W",
                    help="untimed steps of each path (default 2, at least 1): the first of "
                         "ours is checked against the exact average, the last sizes the run")
    gr.add_argument("--size-budget", type=float, default=SIZE_BUDGET_S, metavar="S",
                    help=f"seconds the timed steps should take, both paths together, when "
                         f"choosing the iteration count (default {SIZE_BUDGET_S:g})")
    gr.add_argument("--block", type=_positive_int, default=5, metavar="B",
                    help="timed steps each path runs back to back before the next path's "
                         "turn (default 5; 1 alternates step by step)")
    gr.add_argument("--online", action="store_true",
                    help="also time the same step negotiated online every step (not "
                         "plannable, under other names), alternated with the rest, and print "
                         "how much faster the offline plan is")
    gr.add_argument("--csv", default=None, metavar="PATH",
                    help="also write the table's row to PATH (rank 0)")
    gr.set_defaults(run=run_gradients, check=check_gradients)
    return parser


# --------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # Checked before relaunching, so that a bad command line fails once, here.
    error = args.check(args) if getattr(args, "check", None) else None
    if error:
        parser.error(f"{args.command}: {error}")
    if not under_perseusrun():
        return relaunch(args.np, argv)
    return args.run(args)
