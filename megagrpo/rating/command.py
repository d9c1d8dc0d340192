"""`megagrpo rate RUN_DIR`: the command line of the rating page (megagrpo/rating/__init__.py)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from megagrpo.rating.samples import SampleError, home_of, load_sources, pair
from megagrpo.rating.server import RatingApp, is_loopback, make_server, url_of
from megagrpo.rating.store import RatingError, check_rater, ratings_folder
from megagrpo.rating.summary import console_lines, summarize, write_summary


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="megagrpo rate",
        description="Serve a local page where people score held-out answers 1-5 (or pick the better of two), "
                    "blind to which checkpoint wrote each; ratings go to RUN_DIR/ratings/<rater>.jsonl, their "
                    "aggregates to RUN_DIR/ratings/summary.json, eval_results.json and `megagrpo report`.")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run's output_dir: compares its first held-out evaluation (before GRPO) with its last "
                        "(after); with --against, RUN_DIR's last (or RUN_DIR:STEP) with OTHER. Ratings go to "
                        "RUN_DIR/ratings/")
    p.add_argument("--against", metavar="OTHER",
                   help="the other source: a run's output_dir (its last evaluation), DIR:STEP, a `megagrpo eval "
                        "--output` folder (eval_samples.jsonl) or a samples .jsonl file")
    p.add_argument("--pairwise", action="store_true", help="pick the better answer of each item (A, B or tie) "
                   "instead of scoring each 1-5")
    p.add_argument("--rater", default="", help="the rater name filled in on the page (each rater can type their "
                   "own: letters, digits, '.', '_', '-')")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; any "
                   "other address needs the token)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one, printed)")
    p.add_argument("--token", help="the token every request must carry (default: none on 127.0.0.1, a random one "
                   "printed in the URL elsewhere)")
    p.add_argument("--count", type=int, help="rate at most this many items (the first by held-out index)")
    p.add_argument("--seed", type=int, default=0, help="seed of the blind A/B order (per item and rater; the same "
                   "seed shows a returning rater the same order)")
    p.add_argument("--summary", action="store_true", help="print the aggregates of the ratings so far, write "
                   "summary.json and eval_results.json's \"human\" key, and exit (no server)")
    return p.parse_args(argv)


def print_summary(home: str) -> None:
    summary = summarize(home)
    if not summary:
        print(f"megagrpo rate: no ratings yet in {ratings_folder(home)}")
        return
    path = write_summary(home, summary)
    for line in console_lines(summary):
        print(line)
    print(f"summary: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    home = home_of(args.run_dir)
    try:
        if args.summary:
            print_summary(home)
            return 0
        if args.rater:
            check_rater(args.rater)
        if args.count is not None and args.count < 1:
            raise SampleError(f"--count {args.count}: rate at least one item")
        first, second = load_sources(args.run_dir, args.against)
        items, differ = pair(first, second, args.count)
        app = RatingApp(home, items, [first.name, second.name], args.pairwise, args.seed, args.rater, args.token)
        server = make_server(app, args.host, args.port)
    except (SampleError, RatingError, OSError, json.JSONDecodeError) as e:
        print(f"megagrpo rate: {e}", file=sys.stderr)
        return 2
    if differ:
        print(f"left out {len(differ)} held-out index(es) whose prompts differ between the sources: "
              f"{', '.join(map(str, differ[:10]))}{' ...' if len(differ) > 10 else ''}")
    mode = "pick the better answer (A, B or tie)" if args.pairwise else "score each answer 1-5"
    print(f"megagrpo rate: {len(items)} items, {first.name} vs {second.name} (blind, in random order); {mode}")
    print(f"ratings: {os.path.join(ratings_folder(home), '<rater>.jsonl')} (each saved as it is clicked)")
    if not is_loopback(args.host):
        print(f"bound to {args.host}: every request needs the token in the URL below")
    print(f"open {url_of(server, app)}", flush=True)
    print("stop with Ctrl-C", flush=True)
    # Ctrl-C and a plain kill stop it cleanly, whatever it inherited: a shell starts a job put in
    # the background (`megagrpo rate ... &`) with SIGINT ignored, which Python would keep
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    for line in console_lines(summarize(home, warn=lambda line: None)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
