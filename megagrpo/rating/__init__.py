"""`megagrpo rate`: people score held-out answers, blind to which checkpoint wrote each.

A local web page (the standard library's http.server) shows each held-out prompt with two
answers, one from each source (a run before and after GRPO, or any two runs or checkpoints),
as A and B in an order drawn per item and rater; the rater scores each 1-5, or picks the better
(--pairwise). Each click is one line appended to RUN_DIR/ratings/<rater>.jsonl; a rater who
comes back continues at their first unrated item. The aggregates (mean with a t-interval,
Krippendorff's alpha, win rates) go to ratings/summary.json, eval_results.json's "human" key and
the report's "Human ratings" section.

    samples.py     the two sources, the items they share, the blind A/B order
    store.py       the ratings' JSONL files, rater names
    aggregates.py  the statistics
    summary.py     the aggregates of a run's ratings: summary.json, console lines, report section
    server.py      HTTP: the page and its two JSON calls, token and request checks
    page.py        the page (HTML, inline script)
    command.py     the command line
"""
