"""The rating server: the standard library's ThreadingHTTPServer, one page and two JSON calls.

    GET  /                      the page (page.py)
    GET  /api/items?rater=NAME  the items with answers as A and B in this rater's order, and
                                their earlier ratings (by position), so that a rater resumes
    POST /api/rate              {"rater", "item", "position": "A"|"B", "score": 1-5}, or in
                                pairwise mode {"rater", "item", "choice": "A"|"B"|"tie"}

A bad request gets 400 and {"error": ...}, never a traceback. Bound to a loopback address the
server answers only requests addressed to localhost (a web page elsewhere cannot reach it by
DNS rebinding); bound to any other address, or given a token, every request must carry the
token (?token= in the URL, or the X-Token header) or gets 403. A POST must be JSON
(Content-Type: application/json), which a page of another origin cannot send without asking.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from megagrpo.rating.page import PAGE
from megagrpo.rating.samples import Item, order
from megagrpo.rating.store import RatingError, RatingStore, check_rater
from megagrpo.rating.summary import summarize, write_summary

MAX_BODY = 64 * 1024


class RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RatingApp:
    """A session: the items, the two sources (first, second), the mode and where ratings go."""

    def __init__(self, run_dir: str, items: list[Item], sources: list[str], pairwise: bool = False,
                 seed: int = 0, rater: str = "", token: str = None, log=lambda line: print(line, file=sys.stderr)):
        self.run_dir, self.sources, self.pairwise, self.seed = run_dir, list(sources), pairwise, seed
        self.items = {item.id: item for item in items}
        self.store, self.rater, self.token, self.log = RatingStore(run_dir), rater, token, log
        self._warned: set[str] = set()
        self._saving = threading.Lock()  # one rating and its summary at a time

    def warn_once(self, line: str) -> None:
        if line not in self._warned:
            self._warned.add(line)
            self.log(line)

    def check_access(self, headers, query: dict) -> None:
        if self.token is not None:
            given = headers.get("X-Token") or (query.get("token") or [""])[0]
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise RequestError(403, "this server needs its token: open the URL it printed (…?token=…)")
        else:
            try:
                host = urlsplit(f"//{headers.get('Host', '')}").hostname or ""
            except ValueError:  # not a host name at all
                host = headers.get("Host", "")
            if not is_loopback(host):
                raise RequestError(403, f"requests must be addressed to localhost, not {host!r}")

    def page(self, nonce: str) -> str:
        config = json.dumps({"pairwise": self.pairwise, "rater": self.rater}).replace("<", "\\u003c")
        return PAGE.replace("__NONCE__", nonce).replace("__CONFIG__", config)

    def _rater(self, value) -> str:
        try:
            return check_rater(value)
        except RatingError as e:
            raise RequestError(400, str(e)) from None

    def items_for(self, rater) -> dict:
        """The items in `rater`'s A/B order, and their ratings so far ({id: {"A": 4, ...}} or {id: "B"})."""
        rater = self._rater(rater)
        items, ratings = [], {}
        for item in self.items.values():
            a, b = order(self.seed, rater, item.id, self.sources)
            items.append({"id": item.id, "prompt": item.prompt, "reference": item.reference, "images": item.images,
                          "answers": {"A": item.answers[a], "B": item.answers[b]}})
        positions = {i: dict(zip(order(self.seed, rater, i, self.sources), "AB")) for i in self.items}
        for row in self.store.read(rater, warn=self.warn_once):
            if row["comparison"] != self.sources or row["item"] not in self.items or row["rater"] != rater:
                continue
            where = positions[row["item"]]
            if self.pairwise and "choice" in row:
                ratings[row["item"]] = where.get(row["choice"], "tie")
            elif not self.pairwise and "score" in row:
                ratings.setdefault(row["item"], {})[where[row["source"]]] = row["score"]
        return {"rater": rater, "pairwise": self.pairwise, "items": items, "ratings": ratings}

    def rate(self, body) -> dict:
        """Save one rating (validated; A/B mapped back to the sources); the summary follows."""
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        rater, item = self._rater(body.get("rater")), body.get("item")
        if type(item) is not int or item not in self.items:
            raise RequestError(400, f"unknown item {item!r}: this session rates held-out items "
                                    f"{min(self.items)}..{max(self.items)} ({len(self.items)} of them)")
        sources = order(self.seed, rater, item, self.sources)
        if self.pairwise:
            choice = body.get("choice")
            if choice not in ("A", "B", "tie"):
                raise RequestError(400, f"choice must be \"A\", \"B\" or \"tie\", got {choice!r}")
            rating = {"item": item, "choice": sources["AB".index(choice)] if choice != "tie" else "tie"}
        else:
            position, score = body.get("position"), body.get("score")
            if position not in ("A", "B"):
                raise RequestError(400, f"position must be \"A\" or \"B\", got {position!r}")
            if type(score) is not int or not 1 <= score <= 5:
                raise RequestError(400, f"score must be an integer from 1 to 5, got {score!r}")
            rating = {"item": item, "source": sources["AB".index(position)], "score": score}
        with self._saving:
            self.store.append({**rating, "rater": rater, "comparison": self.sources})
            write_summary(self.run_dir, summarize(self.run_dir, warn=self.warn_once))
        return {"saved": True}


def make_handler(app: RatingApp):
    class Handler(BaseHTTPRequestHandler):
        server_version, sys_version = "megagrpo-rate", ""

        def do_GET(self):
            self._serve()

        def do_POST(self):
            self._serve()

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_POST

        def _serve(self):
            url = urlsplit(self.path)
            try:
                app.check_access(self.headers, parse_qs(url.query))
                route = (self.command, url.path)
                if route == ("GET", "/"):
                    nonce = secrets.token_urlsafe(16)
                    self._send(200, app.page(nonce).encode(), "text/html; charset=utf-8", nonce)
                elif route == ("GET", "/api/items"):
                    self._json(200, app.items_for((parse_qs(url.query).get("rater") or [""])[0]))
                elif route == ("POST", "/api/rate"):
                    self._json(200, app.rate(self._body()))
                else:
                    raise RequestError(404, f"no {self.command} {url.path} here")
            except RequestError as e:
                self._json(e.status, {"error": str(e)})
            except Exception as e:  # said on the console; the page gets one line
                app.log(f"megagrpo rate: {self.command} {url.path} failed: {type(e).__name__}: {e}")
                self._json(500, {"error": f"the server could not do this ({type(e).__name__}); see its console"})

        def _body(self):
            if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                raise RequestError(400, "send the rating as JSON (Content-Type: application/json)")
            length = self.headers.get("Content-Length", "")
            if not length.isdigit() or int(length) > MAX_BODY:
                raise RequestError(400, f"the body needs a Content-Length of at most {MAX_BODY} bytes")
            try:
                return json.loads(self.rfile.read(int(length)))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the body is not JSON: {e}") from None

        def _json(self, status: int, value: dict):
            self._send(status, json.dumps(value).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str, nonce: str = "none"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Content-Security-Policy",
                             f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                             "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                             "frame-ancestors 'none'")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format, *args):  # one line per request would bury the URL
            pass

    return Handler


def make_server(app: RatingApp, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A bound server (port 0: a free one); away from loopback it gets a token if it has none."""
    if app.token is None and not is_loopback(host):
        app.token = secrets.token_urlsafe(16)
    server_class = ThreadingHTTPServer
    if ":" in host:
        server_class = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
    return server_class((host, port), make_handler(app))


def url_of(server: ThreadingHTTPServer, app: RatingApp) -> str:
    host, port = server.server_address[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/" + (f"?token={app.token}" if app.token else "")
