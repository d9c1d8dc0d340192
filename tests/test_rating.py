"""`megagrpo rate`: the statistics on hand-computed numbers, the pairing of two sources, the rater
name and request checks, the token away from localhost, the command's Ctrl-C; and a real headless
Chromium that people's clicks drive through the DevTools Protocol (mouse events at the buttons'
coordinates, typed names, a reload), whose saved ratings and aggregates must be what the clicks
meant. The sources are small JSONL files written here: the answers of step 0 say "xx", those of
step 5 say "yy", each with the score the clicker gives it, so the test knows the hidden source of
every answer the page shows only as A or B."""
import json
import math
import os
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from browser import CHROMIUM_FLAGS
from conftest import PYTHON, ROOT, run

from megagrpo.rating.aggregates import aggregate, krippendorff_alpha, mean_ci, t_quantile, win_rates
from megagrpo.rating.samples import SampleError, load_sources, order, pair
from megagrpo.rating.server import RatingApp, make_server, url_of
from megagrpo.rating.store import RatingError, RatingStore, check_rater
from megagrpo.rating.summary import report_section
from megagrpo.report import render

X_SCORES = [2, 3, 1, 2, 4, 3]  # step 0's answers (they say "xx"), items 0-5
Y_SCORES = [4, 5, 3, 4, 4, 5]  # step 5's answers ("yy")
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
         "AAAABJRU5ErkJggg==")
# headless Chromium as tests/test_report.py runs it (Debian's chromium), its DevTools port added below
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'


def write_rows(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def make_run(folder):
    """A run's two held-out evaluations: items 0-5 in both, 6 only before, 7 with another prompt."""
    def rows(tag, scores, extra):
        out = []
        for i, score in enumerate(scores):
            prompt = f"What is {i} + {i}?" if i != 5 else "What is <b>2</b>+2? <img src=x onerror=window.pwned=3>"
            text = f"{tag} says {score}" + (f" {HOSTILE}" if i == 5 and tag == "xx" else "")
            out.append({"index": i, "prompt": prompt, "reference": str(2 * i) if i < 3 else None,
                        "completions": [text, "a second completion, never shown"], "reward": [0.5, 0.0],
                        **({"images": [PIXEL, "javascript:alert(1)", "http://example.com/x.png"]} if i == 1 else {})})
        return out + extra
    write_rows(folder / "eval_samples" / "step_00000000.jsonl",
               rows("xx", X_SCORES, [{"index": 6, "prompt": "only before", "completions": ["xx says 1"]},
                                     {"index": 7, "prompt": "one prompt", "completions": ["xx says 1"]}]))
    write_rows(folder / "eval_samples" / "step_00000005.jsonl",
               rows("yy", Y_SCORES, [{"index": 7, "prompt": "another prompt", "completions": ["yy says 1"]}]))
    (folder / "eval_results.json").write_text(json.dumps({"before": {"reward": 0.1}, "after": {"reward": 0.9}}))
    return folder


# ---- the statistics, on numbers computed by hand ---------------------------------------------

def test_t_quantiles_match_the_tables_and_the_interval_is_the_t_interval():
    for df, table in ((1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (30, 2.0423), (1000, 1.9623)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-4), df
    assert t_quantile(0.95, 4) == pytest.approx(2.1318, abs=1e-4)
    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), half width 3.18245 * sd / 2
    mean, low, high = mean_ci([1, 2, 3, 4])
    assert (mean, low, high) == pytest.approx((2.5, 0.44574, 4.55426), abs=1e-5)
    assert mean_ci([3, 3, 3]) == (3.0, 3.0, 3.0) and mean_ci([4]) == (4.0, None, None)


def test_krippendorff_alpha_on_the_published_example_and_by_hand():
    # Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability": 4 observers, 12 units;
    # nominal 0.743, interval 0.849 (the unit with one value is not pairable)
    observers = ["1 2 3 3 2 1 4 1 2 . . .", "1 2 3 3 2 2 4 1 2 5 . 3", ". 3 3 3 2 3 4 2 2 5 1 .",
                 "1 2 3 3 2 4 4 1 2 5 1 ."]
    units = [[int(v) for v in unit if v != "."] for unit in zip(*(o.split() for o in observers))]
    assert krippendorff_alpha(units, "nominal") == pytest.approx(0.743, abs=5e-4)
    assert krippendorff_alpha(units, "interval") == pytest.approx(0.849, abs=5e-4)
    # (1,1), (2,3), (3,3): D_o = 2/6; D_e = (2*6*33 - 2*13^2) / (6*5) = 58/30
    assert krippendorff_alpha([[1, 1], [2, 3], [3, 3], [5]]) == pytest.approx(1 - (2 / 6) / (58 / 30))
    assert krippendorff_alpha([[4, 4], [4, 4]]) is None and krippendorff_alpha([[1], [2]]) is None
    assert krippendorff_alpha([["a", "b"], ["a", "a"]], "nominal") == pytest.approx(1 - (2 / 4) / (6 / 12))


def test_aggregate_of_rating_lines():
    """Means over items of each item's mean over raters, the last rating winning; win rates of
    (rater, item) judgments with ties half; alpha over the answers two raters scored."""
    s = ["before", "after"]
    lines = [{"rater": "a", "item": 1, "source": "before", "score": 1},
             {"rater": "a", "item": 1, "source": "before", "score": 2},  # replaces the 1
             {"rater": "a", "item": 1, "source": "after", "score": 4},
             {"rater": "b", "item": 1, "source": "before", "score": 3},
             {"rater": "b", "item": 1, "source": "after", "score": 4},
             {"rater": "a", "item": 2, "source": "before", "score": 5},
             {"rater": "a", "item": 2, "source": "after", "score": 5},
             {"rater": "a", "item": 3, "source": "after", "score": 1},
             {"rater": "a", "item": 1, "choice": "after"}, {"rater": "b", "item": 1, "choice": "tie"},
             {"rater": "a", "item": 2, "choice": "before"}]
    agg = aggregate(lines, s)
    # before: item 1 (2+3)/2, item 2: 5 -> 3.75; after: 4, 5, 1 -> 10/3
    assert agg["scores"]["before"]["mean"] == 3.75 and agg["scores"]["before"]["items"] == 2
    assert agg["scores"]["before"]["ratings"] == 3 and agg["scores"]["after"]["ratings"] == 4
    # sd of 2.5 and 5: 2.5 / sqrt(2); half width t(0.975, 1) * sd / sqrt(2) = 12.7062 * 1.25
    assert agg["scores"]["before"]["ci95_t"] == pytest.approx([3.75 - 12.7062 * 1.25, 3.75 + 12.7062 * 1.25], abs=1e-3)
    assert agg["scores"]["after"]["mean"] == pytest.approx(10 / 3)
    # judgments: a item 1 (2 < 4), b item 1 (3 < 4), a item 2 (5 = 5): after 2.5 of 3
    assert agg["score_win_rate"] == {"before": pytest.approx(0.5 / 3), "after": pytest.approx(2.5 / 3),
                                     "judgments": 3}
    assert agg["score_agreement"] == {"krippendorff_alpha_interval": krippendorff_alpha([[2, 3], [4, 4]]),
                                      "answers_with_2_raters": 2}
    assert agg["pairwise"]["win_rate"] == {"before": 1.5 / 3, "after": 1.5 / 3, "judgments": 3}
    assert agg["pairwise"]["krippendorff_alpha_nominal"] == 0.0  # one unit, "after" vs "tie": D_o = D_e = 1
    assert agg["raters"] == {"a": {"scores": 5, "choices": 2}, "b": {"scores": 2, "choices": 1}}
    assert win_rates([], s) == {"before": None, "after": None, "judgments": 0}


# ---- sources, items, names ----------------------------------------------------------------

def test_sources_pair_by_index_and_prompt(tmp_path):
    run_dir = make_run(tmp_path / "run")
    first, second = load_sources(str(run_dir))
    assert (first.name, second.name) == ("step 0", "step 5")
    items, differ = pair(first, second)
    assert [i.id for i in items] == [0, 1, 2, 3, 4, 5] and differ == [7]
    assert items[1].answers == {"step 0": "xx says 3", "step 5": "yy says 5"}  # the first completion
    assert items[1].images == [PIXEL] and items[0].reference == "0" and items[4].reference is None
    assert [i.id for i in pair(first, second, count=2)[0]] == [0, 1]
    # another run, a step, an eval output folder, a file; names relative to the rating run
    other = make_run(tmp_path / "other")
    write_rows(tmp_path / "eval" / "eval_samples.jsonl", [{"index": 0, "prompt": "What is 0 + 0?",
                                                           "completions": ["0"]}])
    assert [s.name for s in load_sources(str(run_dir), str(other))] == ["step 5", "../other:step 5"]
    assert [s.name for s in load_sources(f"{run_dir}:0", f"{other}:0")] == ["step 0", "../other:step 0"]
    sources = load_sources(str(run_dir), str(tmp_path / "eval"))
    assert sources[1].name == "../eval/eval_samples.jsonl" and [i.id for i in pair(*sources)[0]] == [0]
    assert load_sources(str(run_dir), str(tmp_path / "eval" / "eval_samples.jsonl"))[1].name == sources[1].name
    for args, message in (((str(tmp_path / "eval"),), "held-out evaluation"),
                          ((f"{run_dir}:3", str(other)), "no held-out samples at step 3 .* its steps: 0, 5"),
                          ((str(run_dir), f"{run_dir}:5"), "both sources are"),
                          ((str(run_dir), str(tmp_path / "nothing")), "no held-out samples. Name a run's")):
        with pytest.raises(SampleError, match=message):
            load_sources(*args)
    write_rows(tmp_path / "far" / "eval_samples.jsonl", [{"index": 9, "prompt": "?", "completions": ["a"]}])
    with pytest.raises(SampleError, match="share no held-out prompt"):
        pair(*load_sources(str(run_dir), str(tmp_path / "far")))


def test_rater_names_and_the_blind_order(tmp_path):
    for good in ("alice", "j.smith", "B_2-x", "a" * 64):
        assert check_rater(good) == good
    for bad in ("", "../x", "a b", "a/b", ".hidden", "-x", "a" * 65, "é", None, 5):
        with pytest.raises(RatingError, match="cannot name a file"):
            check_rater(bad)
    store = RatingStore(str(tmp_path))
    with pytest.raises(RatingError):
        store.path("../../etc/passwd")
    # a fixed coin per (seed, rater, item): both orders occur, and another seed changes some
    s = ["step 0", "step 5"]
    orders = [order(0, "alice", i, s) for i in range(6)]
    assert orders == [order(0, "alice", i, s) for i in range(6)] and s in orders and s[::-1] in orders
    assert orders != [order(1, "alice", i, s) for i in range(6)]


# ---- the server's checks, by plain HTTP ---------------------------------------------------------

def serve(app, host="127.0.0.1"):
    server = make_server(app, host, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def request(url, body=None, headers=None, raw=None):
    """(status, JSON or text) of a GET, or of a POST of `body` as JSON (or `raw` bytes)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=10) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@pytest.fixture
def app(tmp_path):
    run_dir = make_run(tmp_path / "run")
    first, second = load_sources(str(run_dir))
    return RatingApp(str(run_dir), pair(first, second)[0], [first.name, second.name], log=lambda line: None)


def test_bad_requests_get_400_with_a_json_error(app):
    server, base = serve(app)
    try:
        rate = f"{base}/api/rate"
        good = {"rater": "alice", "item": 2, "position": "A", "score": 3}
        for body, raw, headers, message in (
                (None, b"{not json", None, "not JSON"), ([1, 2], None, None, "JSON object"),
                ({**good, "item": 99}, None, None, "unknown item 99"), ({**good, "item": "2"}, None, None, "unknown"),
                ({**good, "score": 0}, None, None, "1 to 5"), ({**good, "score": 6}, None, None, "1 to 5"),
                ({**good, "score": "3"}, None, None, "1 to 5"), ({**good, "score": True}, None, None, "1 to 5"),
                ({**good, "score": 3.0}, None, None, "1 to 5"), ({**good, "position": "C"}, None, None, "position"),
                ({**good, "rater": "../x"}, None, None, "cannot name a file"),
                ({"item": 2, "position": "A", "score": 3}, None, None, "cannot name a file"),
                (good, None, {"Content-Type": "text/plain"}, "as JSON"), (None, b"\xff\xfe", None, "not JSON")):
            status, answer = request(rate, body, headers, raw)
            assert status == 400 and message in answer["error"], (body, raw, answer)
        assert request(f"{base}/api/items?rater=a%20b")[0] == 400
        assert request(f"{base}/nothing")[0] == 404
        status, answer = request(rate, good)
        assert status == 200 and answer == {"saved": True}
        lines = RatingStore(app.run_dir).read("alice")
        assert len(lines) == 1 and lines[0]["source"] == order(0, "alice", 2, app.sources)[0]
        # addressed to another host name (DNS rebinding): refused
        assert request(f"{base}/", headers={"Host": "evil.example:80"})[0] == 403
        app.pairwise = True
        assert request(rate, good)[1]["error"].startswith("choice must be")
        assert request(rate, {"rater": "alice", "item": 2, "choice": "tie"})[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_away_from_localhost_every_request_needs_the_token(app):
    server, base = serve(app, "0.0.0.0")
    try:
        assert app.token and url_of(server, app).endswith(f"/?token={app.token}")  # generated, printed
        for path, body in (("/", None), ("/api/items?rater=alice", None),
                           ("/api/rate", {"rater": "alice", "item": 1, "position": "A", "score": 2})):
            assert request(base + path, body)[0] == 403, path
            assert request(base + path + ("&" if "?" in path else "?") + "token=wrong", body)[0] == 403
            assert request(base + path, body, {"X-Token": app.token})[0] == 200, path
        assert request(f"{base}/?token={app.token}")[0] == 200
        assert len(RatingStore(app.run_dir).read()) == 1  # only the request with the token saved
    finally:
        server.shutdown()
        server.server_close()


def test_the_command_serves_until_ctrl_c_and_checks_its_input(tmp_path):
    run_dir = make_run(tmp_path / "run")
    proc = subprocess.Popen([PYTHON, "-m", "megagrpo.cli", "rate", str(run_dir), "--port", "0", "--rater", "alice"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("stop with")):
            lines.append(proc.stdout.readline().strip())
            assert lines[-1] or proc.poll() is None, (lines, proc.stderr.read())
        url = next(line.split()[1] for line in lines if line.startswith("open http://127.0.0.1:"))
        assert request(url)[0] == 200 and ":8765/" not in url  # --port 0: the port it got
        assert request(url + "api/rate", {"rater": "alice", "item": 0, "position": "A", "score": 5})[0] == 200
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert lines[0] == "left out 1 held-out index(es) whose prompts differ between the sources: 7"
    assert lines[1] == "megagrpo rate: 6 items, step 0 vs step 5 (blind, in random order); score each answer 1-5"
    assert "human ratings, step 0 vs step 5: mean score" in out
    for args, message in (([str(tmp_path)], "0 held-out evaluation(s)"), ([str(run_dir), "--rater", "a b"],
                                                                          "cannot name a file")):
        proc = run([PYTHON, "-m", "megagrpo.cli", "rate", *args], check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


# ---- a real browser, real clicks ------------------------------------------------------------

class Tab:
    """One Chromium tab over the DevTools Protocol; what its console says (console.*, uncaught
    exceptions, the browser's own error log) gathers in .console."""

    def __init__(self, socket):
        self.socket, self.last_id, self.console = socket, 0, []
        for domain in ("Runtime", "Page", "Log"):
            self.send(f"{domain}.enable")

    def send(self, method, **params):
        self.last_id += 1
        self.socket.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == self.last_id:
                assert "error" not in message, (method, message)
                return message.get("result", {})
            event, params = message.get("method"), message.get("params", {})
            if event == "Runtime.consoleAPICalled":
                self.console.append(f"console.{params['type']}: " + " ".join(
                    str(a.get("value", a.get("description"))) for a in params["args"]))
            elif event == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                self.console.append(f"exception: {details.get('exception', {}).get('description', details['text'])}")
            elif event == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                self.console.append(f"log: {params['entry']['text']}")

    def evaluate(self, expression):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait(self, expression, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.evaluate(expression):
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {expression}; console: {self.console}")

    def load(self, method, **params):
        """Navigate or reload, then wait for the new page to have set itself up."""
        self.evaluate("window.oldPage = true")
        self.send(method, **params)
        self.wait("!window.oldPage && document.readyState === 'complete' && !!document.body.dataset.item")

    def click(self, selector):
        """A left click at the middle of the element, as the mouse would (it must be what is there)."""
        point = self.evaluate(f"""(() => {{
            const e = document.querySelector({json.dumps(selector)});
            if (!e) return null;
            e.scrollIntoView({{block: "center"}});
            const r = e.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
            return document.elementFromPoint(x, y) === e ? [x, y] : null;
        }})()""")
        assert point, f"{selector} is not on the page where a click can reach it"
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=point[0], y=point[1], button="left", clickCount=1)

    def type_name(self, name):
        self.click("#rater")
        self.evaluate("document.getElementById('rater').select()")
        self.send("Input.insertText", text=name)

    def text(self, element_id):
        return self.evaluate(f"document.getElementById({json.dumps(element_id)}).textContent")


@pytest.fixture(scope="module")
def tab(tmp_path_factory):
    from websockets.sync.client import connect

    profile = tmp_path_factory.mktemp("chromium")
    with open(profile / "stderr.txt", "w") as log:
        browser = subprocess.Popen(["chromium", *CHROMIUM_FLAGS, "--remote-debugging-port=0",
                                    f"--user-data-dir={profile / 'profile'}", "--window-size=1280,900", "about:blank"],
                                   stdout=log, stderr=log)
    try:
        ports = profile / "profile" / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (ports.is_file() and ports.read_text().count("\n") >= 1) and time.time() < deadline:
            time.sleep(0.05)
        assert ports.is_file(), (profile / "stderr.txt").read_text()[-3000:]
        port = int(ports.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as socket:
            tab = Tab(socket)
            tab.evaluate("console.error('probe')")  # the capture works
            assert tab.console == ["console.error: probe"], tab.console
            tab.console.clear()
            yield tab
    finally:
        browser.kill()
        browser.wait()


def said(text):
    """The score written in an answer: 'xx says 3 ...' -> ('xx', 3)."""
    found = re.match(r"(xx|yy) says (\d)", text)
    return found.group(1), int(found.group(2))


def rate_items(tab, scores_of, stop_after=None, first_only_of_last=False):
    """Click through the page: each shown item's two answers scored scores_of(item, tag, said); returns
    [(item, tag at A)]. stop_after: stop after that many items (the last one half-rated with
    first_only_of_last)."""
    seen = []
    while tab.evaluate("document.body.dataset.item") != "done" and len(seen) != stop_after:
        item = int(tab.evaluate("document.body.dataset.item"))
        tags = {}
        for position in "AB":
            tag, number = said(tab.text(f"answer-{position}"))
            tags[position] = tag
            if first_only_of_last and len(seen) + 1 == stop_after and position == "B":
                break
            if tab.evaluate(f"!!document.querySelector('#scores-{position} [aria-pressed=true]')"):
                continue  # scored before a reload
            saved = int(tab.evaluate("document.body.dataset.saved"))
            tab.click(f'#scores-{position} button[data-score="{scores_of(item, tag, number)}"]')
            tab.wait(f"document.body.dataset.saved === '{saved + 1}'")
        assert not re.search(r"step \d", tab.evaluate("document.body.innerText"))  # blind
        seen.append((item, tags["A"]))
    return seen


def test_raters_click_scores_resume_and_the_aggregates_follow(tab, tmp_path):
    run_dir = make_run(tmp_path / "run")
    first, second = load_sources(str(run_dir))
    app = RatingApp(str(run_dir), pair(first, second)[0], ["step 0", "step 5"], rater="alice", log=lambda line: None)
    server, base = serve(app)
    try:
        tab.load("Page.navigate", url=f"{base}/")
        assert tab.evaluate("document.getElementById('rater').value") == "alice"  # --rater, filled in
        tab.click("#start")
        tab.wait("document.body.dataset.item === '0'")
        # item 0 shows its reference; the hostile prompt and answer of item 5 and the images of item 1 come later
        assert tab.text("reference") == "0"
        seen = []
        while tab.evaluate("document.body.dataset.item") != "done":
            item = int(tab.evaluate("document.body.dataset.item"))
            if item == 1:  # the one data: image of three
                assert tab.evaluate("[...document.querySelectorAll('#images img')].map(i => i.src)") == [PIXEL]
            if item == 5:  # hostile text stays text
                assert "<b>2</b>" in tab.text("prompt") and HOSTILE in tab.text("answer-A") + tab.text("answer-B")
                assert tab.evaluate("document.querySelectorAll('#rating script, #rating pre *, #prompt *').length") == 0
            seen += rate_items(tab, lambda item, tag, number: number, stop_after=1)
        assert [i for i, _ in seen] == [0, 1, 2, 3, 4, 5]
        assert {a for _, a in seen} == {"xx", "yy"}  # both orders were shown
        assert "All 6 items rated" in tab.text("done-text")
        # alice changes her mind about item 0's "xx" answer: 2 -> 5 (a new line; the last one wins)
        tab.click("#review")
        tab.wait("document.body.dataset.item === '0'")
        position = "A" if said(tab.text("answer-A"))[0] == "xx" else "B"
        tab.click(f'#scores-{position} button[data-score="5"]')
        tab.wait("document.body.dataset.item === 'done'")
        # bob: types his name, scores "yy" one lower on items 0, 2, 4, stops half-way through item 3
        bob = lambda item, tag, number: number - 1 if tag == "yy" and item in (0, 2, 4) else number
        tab.load("Page.navigate", url=f"{base}/")
        tab.type_name("bob")
        tab.click("#start")
        tab.wait("document.body.dataset.item === '0'")
        rate_items(tab, bob, stop_after=4, first_only_of_last=True)
        assert tab.evaluate("document.body.dataset.item") == "3"
        tab.load("Page.reload")  # he comes back: the page goes on at his first unrated item
        assert tab.evaluate("document.body.dataset.item") == "3" and "rater bob" in tab.text("progress")
        assert tab.evaluate("document.getElementById('login').hidden")
        assert tab.evaluate("document.querySelectorAll('button[aria-pressed=true]').length") == 1  # A of item 3
        rate_items(tab, bob)
        assert tab.evaluate("window.pwned === undefined")
        assert tab.console == [], tab.console
    finally:
        server.shutdown()
        server.server_close()
    # what the clicks meant, from the test's own knowledge of which source said what
    alice_x, bob_y = [5, *X_SCORES[1:]], [s - 1 if i in (0, 2, 4) else s for i, s in enumerate(Y_SCORES)]
    expected = {"step 0": [(a + b) / 2 for a, b in zip(alice_x, X_SCORES)],
                "step 5": [(a + b) / 2 for a, b in zip(Y_SCORES, bob_y)]}
    lines = {rater: [json.loads(line) for line in open(run_dir / "ratings" / f"{rater}.jsonl")]
             for rater in ("alice", "bob")}
    assert len(lines["alice"]) == 13 and len(lines["bob"]) == 12  # nothing lost
    for line in lines["alice"][:12]:
        assert line["score"] == (X_SCORES if line["source"] == "step 0" else Y_SCORES)[line["item"]], line
    summary = json.load(open(run_dir / "ratings" / "summary.json"))["step 0 vs step 5"]
    for source, item_means in expected.items():
        stats = summary["scores"][source]
        half = 2.570582 * statistics.stdev(item_means) / math.sqrt(6)  # t(0.975, 5)
        assert stats["mean"] == pytest.approx(statistics.mean(item_means)) and stats["items"] == 6
        assert stats["ci95_t"] == pytest.approx([stats["mean"] - half, stats["mean"] + half], abs=1e-5)
    judgments = [(x, y) for xs, ys in ((alice_x, Y_SCORES), (X_SCORES, bob_y)) for x, y in zip(xs, ys)]
    wins = sum(y > x for x, y in judgments) + 0.5 * sum(x == y for x, y in judgments)
    assert summary["score_win_rate"]["step 5"] == pytest.approx(wins / 12) and wins == 9.5
    units = [[a, b] for xs, ys in ((alice_x, X_SCORES), (Y_SCORES, bob_y)) for a, b in zip(xs, ys)]
    assert summary["score_agreement"] == {"krippendorff_alpha_interval": pytest.approx(krippendorff_alpha(units)),
                                          "answers_with_2_raters": 12}
    assert summary["raters"] == {"alice": {"scores": 12, "choices": 0}, "bob": {"scores": 12, "choices": 0}}
    results = json.load(open(run_dir / "eval_results.json"))
    assert results["before"] == {"reward": 0.1} and results["human"]["step 0 vs step 5"] == summary
    proc = run([PYTHON, "-m", "megagrpo.cli", "rate", str(run_dir), "--summary"])
    assert (f"human ratings, step 0 vs step 5: mean score step 0 {statistics.mean(expected['step 0']):.2f} "
            in proc.stdout and "scored higher in 0.79 of 12 judgments" in proc.stdout), proc.stdout
    section = report_section(str(run_dir))
    assert 'id="panel-human"' in section and f"{statistics.mean(expected['step 5']):.2f}" in section
    assert report_section(str(tmp_path)) == ""
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/kl": 0.5}\n')
    page = open(render(str(run_dir))).read()
    assert page.index('id="panel-samples"') < page.index(section) and page.count('id="panel-human"') == 1


def test_pairwise_clicks_give_the_win_rate(tab, tmp_path):
    run_dir = make_run(tmp_path / "run")
    first, second = load_sources(str(run_dir))
    app = RatingApp(str(run_dir), pair(first, second)[0], ["step 0", "step 5"], pairwise=True, log=lambda line: None)
    server, base = serve(app)
    try:
        tab.load("Page.navigate", url=f"{base}/")
        assert tab.evaluate("document.getElementById('rater').value") == ""
        tab.type_name("carol smith")  # refused, saying why; the browser logs the 400
        tab.click("#start")
        tab.wait("document.getElementById('status').textContent.includes('cannot name a file')")
        assert [line for line in tab.console if "status of 400" not in line] == [], tab.console
        tab.console.clear()
        tab.type_name("carol")
        tab.click("#start")
        tab.wait("document.body.dataset.item === '0'")
        assert tab.evaluate("document.getElementById('scores-A').hidden")
        while tab.evaluate("document.body.dataset.item") != "done":
            a, b = said(tab.text("answer-A"))[1], said(tab.text("answer-B"))[1]
            saved = int(tab.evaluate("document.body.dataset.saved"))
            tab.click(f'button[data-choice="{"tie" if a == b else "A" if a > b else "B"}"]')
            tab.wait(f"document.body.dataset.saved === '{saved + 1}'")
        assert tab.console == [], tab.console
    finally:
        server.shutdown()
        server.server_close()
    choices = {r["item"]: r["choice"] for r in map(json.loads, open(run_dir / "ratings" / "carol.jsonl"))}
    assert choices == {i: "tie" if x == y else "step 5" if y > x else "step 0"
                       for i, (x, y) in enumerate(zip(X_SCORES, Y_SCORES))}
    pairwise = json.load(open(run_dir / "ratings" / "summary.json"))["step 0 vs step 5"]["pairwise"]
    assert pairwise["win_rate"] == {"step 0": pytest.approx(0.5 / 6), "step 5": pytest.approx(5.5 / 6),
                                    "judgments": 6}
