"""An OpenAI-compatible endpoint in front of the generator, for agent programs megagrpo did
not write (rollout/outside_agents.py runs them).

    GET  /episodes/<key>/v1/models             the policy, under rollout.agent_model_name
    POST /episodes/<key>/v1/chat/completions   messages (+ tools) -> one assistant turn; stream too
    POST /episodes/<key>/v1/completions        a text (or token-id) prompt -> its continuation

The key ties every request to its episode: it is in the base URL each agent is given, and is
also accepted as the API key (`Authorization: Bearer <key>`) on plain `/v1/...` paths. What the
generator is fed and what it samples go into the episode as tokens (rollout/episodes.py); the
agent gets text: the turn decoded, its tool calls parsed by rollout.tool_call_parser and returned
as OpenAI `tool_calls`.

Sampling follows the rollout, not the request: temperature, top_p and top_k are the run's (the
trainer's log-probs assume them), `n` must be 1, and max_tokens is capped by
rollout.max_new_tokens and the episode's room in the context budget. Streaming sends the turn
once it is sampled, as OpenAI's chunks ending in `[DONE]`.

Concurrent requests of all the episodes meet in one Batcher, which hands them to the generator
as one call, so the engine batches them: it waits until every running agent has a request in,
or rollout.agent_batch_window_s has passed since the first. Errors come back as OpenAI's error
bodies: malformed JSON and bad fields (400), another model name (404), an unknown key (401).
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from megagrpo.policy.batch import Completion
from megagrpo.rollout.agent import ToolMessageRenderer, turn_seed
from megagrpo.rollout.episodes import Episode, RequestError

TOOL_CALL_MARK = "<tool_call>"  # where a Hermes-style turn's calls begin: the reply's content ends there


class Batcher:
    """Requests from many threads, sampled by the generator in one call per batch."""

    def __init__(self, sample: Callable[[list, list, list], list], window_s: float):
        """sample(ids per request, seeds, max_tokens) -> one Completion per request."""
        self.sample_many, self.window_s = sample, window_s
        self.cond = threading.Condition()
        self.pending: list[dict] = []
        self.running = 0  # agent programs running: a batch waits for all of them, or the window
        self.in_flight_max = 0
        threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True).start()

    def sample(self, ids: list[int], seed: int, max_tokens: int) -> Completion:
        request = {"ids": ids, "seed": seed, "max_tokens": max_tokens, "done": threading.Event()}
        with self.cond:
            self.pending.append(request)
            self.cond.notify_all()
        request["done"].wait()
        if "error" in request:
            raise RequestError(f"the generator failed: {request['error']}", status=500, code="generator_error")
        return request["completion"]

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                deadline = time.monotonic() + self.window_s
                while len(self.pending) < self.running and time.monotonic() < deadline:
                    self.cond.wait(max(0.0, deadline - time.monotonic()))
                batch, self.pending = self.pending, []
                self.in_flight_max = max(self.in_flight_max, len(batch))
            try:
                completions = self.sample_many([r["ids"] for r in batch], [r["seed"] for r in batch],
                                               [r["max_tokens"] for r in batch])
                for request, completion in zip(batch, completions):
                    request["completion"] = completion
            except Exception as e:  # every waiting request hears of it; the loop lives on
                for request in batch:
                    request["error"] = f"{type(e).__name__}: {e}"
            for request in batch:
                request["done"].set()


class Endpoint:
    """The HTTP server, on 127.0.0.1 and a free port, for the episodes registered with it."""

    def __init__(self, model_name: str, tokenizer, parse, batcher: Batcher, max_len: int, max_new_tokens: int,
                 max_calls: int, host: str = "127.0.0.1"):
        self.model_name, self.tokenizer, self.parse, self.batcher = model_name, tokenizer, parse, batcher
        self.max_len, self.max_new_tokens, self.max_calls = max_len, max_new_tokens, max_calls
        self.renderer = ToolMessageRenderer(tokenizer, max_len)  # an agent's own messages are not cut
        self.episodes: dict[str, Episode] = {}
        self.server = _Server((host, 0), _Handler)
        self.server.daemon_threads = True
        self.server.endpoint = self
        threading.Thread(target=self.server.serve_forever, name="endpoint", daemon=True).start()

    def url(self, key: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/episodes/{key}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- requests ---------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers, body: bytes) -> tuple[int, object]:
        """(HTTP status, the JSON reply or a list of stream chunks) for one request."""
        key, route = _split(path, headers)
        if method == "GET" and route == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                     "owned_by": "megagrpo"}]}
        if method != "POST" or route not in ("/v1/chat/completions", "/v1/completions"):
            raise RequestError(f"no route {method} {route}: this endpoint serves GET /v1/models, POST "
                               "/v1/chat/completions and POST /v1/completions", status=404, code="unknown_route")
        try:
            request = json.loads(body or b"")
        except (ValueError, RecursionError) as e:
            raise RequestError(f"the request body is not JSON: {e}", code="malformed_json") from None
        if not isinstance(request, dict):
            raise RequestError("the request body must be a JSON object", code="malformed_json")
        if request.get("model") != self.model_name:
            raise RequestError(f"The model `{request.get('model')}` does not exist: this endpoint serves "
                               f"`{self.model_name}`", status=404, code="model_not_found", param="model")
        if request.get("n", 1) != 1:
            raise RequestError("'n' must be 1: an episode samples one turn per request", param="n")
        episode = self.episodes.get(key or "")
        if episode is None:
            raise RequestError("no running episode has this key: use the base URL (or API key) the agent was "
                               "given", status=401, code="invalid_api_key")
        with episode.lock:  # an episode's requests take turns
            if episode.ended:
                raise RequestError(f"this episode has ended ({episode.ended})", code="episode_ended")
            chat = route == "/v1/chat/completions"
            reply = self._chat(episode, request) if chat else self._text(episode, request)
        return 200, _stream(reply, chat, request) if request.get("stream") else reply

    def _chat(self, episode: Episode, request: dict) -> dict:
        ids = episode.chat_input(request.get("messages"), request.get("tools"), self.tokenizer, self.renderer)
        completion = self._sample(episode, ids, request)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        calls = [c for c in self.parse(self.tokenizer.decode(completion.token_ids, skip_special_tokens=False))
                 if c.error is None] if request.get("tools") else []
        message = {"role": "assistant", "content": text.split(TOOL_CALL_MARK)[0].strip() if calls else text}
        if calls:
            message["tool_calls"] = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
        episode.add_turn(completion, text, message, self.tokenizer.eos_token_id)
        finish = "tool_calls" if calls else "length" if completion.truncated else "stop"
        return _body("chat.completion", {"index": 0, "message": message, "finish_reason": finish, "logprobs": None},
                     self.model_name, len(ids), len(completion.token_ids))

    def _text(self, episode: Episode, request: dict) -> dict:
        ids = episode.text_input(request.get("prompt"), self.tokenizer)
        completion = self._sample(episode, ids, request)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        episode.add_turn(completion, text, None, self.tokenizer.eos_token_id)
        finish = "length" if completion.truncated else "stop"
        return _body("text_completion", {"index": 0, "text": text, "finish_reason": finish, "logprobs": None},
                     self.model_name, len(ids), len(completion.token_ids))

    def _sample(self, episode: Episode, ids: list[int], request: dict) -> Completion:
        room = self.max_len - len(ids)
        if room < 1:
            episode.ended = "budget"
            raise RequestError(f"this episode has reached the rollout's context budget ({self.max_len} tokens)",
                               code="context_length_exceeded")
        if episode.calls >= self.max_calls:
            raise RequestError(f"this episode has made its {self.max_calls} model calls (rollout.max_turns)",
                               code="max_turns_reached")
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise RequestError(f"max_tokens: {asked!r} must be a positive integer", param="max_tokens")
        start = time.perf_counter()
        completion = self.batcher.sample(ids, turn_seed(episode.seed, episode.calls),
                                         min(self.max_new_tokens, room, asked or room))
        episode.model_seconds += time.perf_counter() - start
        return completion


def _split(path: str, headers) -> tuple[Optional[str], str]:
    """(episode key, route) from /episodes/<key>/v1/... or from /v1/... and the bearer key."""
    path = path.split("?")[0].rstrip("/")
    if path.startswith("/episodes/"):
        key, _, rest = path[len("/episodes/"):].partition("/")
        return key, "/" + rest
    auth = headers.get("Authorization", "")
    return (auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None), path


def _body(kind: str, choice: dict, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}", "object": kind,
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _stream(reply: dict, chat: bool, request: dict) -> list[dict]:
    """A sampled reply as the chunks of OpenAI's stream (the turn in one content chunk)."""
    choice = reply["choices"][0]
    base = {"id": reply["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": reply["created"], "model": reply["model"]}
    if chat:
        message = choice["message"]
        deltas = [{"role": "assistant", "content": message["content"]}]
        deltas += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls", []))]
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
    else:
        chunks = [{**base, "choices": [{"index": 0, "text": choice["text"], "finish_reason": choice["finish_reason"],
                                        "logprobs": None}]}]
    if (request.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "choices": [], "usage": reply["usage"]})
    return chunks


class _Server(ThreadingHTTPServer):
    # socketserver's default backlog (5) refused connections when 64 agents called at once
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes: the body must not wait for the client's ACK of the
    # headers (Nagle's algorithm against a delayed ACK)
    disable_nagle_algorithm = True

    def do_GET(self):  # noqa: N802 (http.server's names)
        self._serve("GET")

    def do_POST(self):  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            status, reply = self.server.endpoint.handle(method, self.path, self.headers, body)
        except RequestError as e:
            status, reply = e.status, {"error": {"message": str(e), "type": "invalid_request_error",
                                                 "param": e.param, "code": e.code}}
        except Exception as e:  # a bug here must not hang the agent: it gets a 500 with the reason
            status, reply = 500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                            "param": None, "code": None}}
        if isinstance(reply, list):  # a stream
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in reply:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # no line per request on the trainer's console
        pass
