"""Tools a model calls during a multi-turn rollout, and the parser of its tool calls.

A tool is a name, a JSON schema (what the chat template shows the model) and a call that takes
the call's arguments and returns text. Three kinds (rollout.tools, rollout.environment):
- `python` (built-in): runs the call's `code` in the sandbox (megagrpo/sandbox: bubblewrap,
  seccomp, rlimits, a timeout; `mode: auto` refuses to start without bubblewrap) and returns
  its stdout, or its error;
- a function by dotted path `module:function`: its schema comes from its type hints and its
  docstring (transformers' `get_json_schema`); it runs in this process, on a thread, with a
  timeout;
- the public methods of an environment class: bound to the trajectory's own instance.

A tool call is parsed out of the model's text by a named, replaceable parser
(rollout.tool_call_parser: `hermes`, or `module:function` returning a list of ParsedCall).
Whatever the model writes, a call never raises: a malformed call, an unknown tool, wrong
arguments, a tool that raises or times out all become a short error text the model reads in
the tool message, counted by kind (ERROR_KINDS).
"""
from __future__ import annotations

import inspect
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from megagrpo.config.loading import resolve_dotted
from megagrpo.config.schema import ConfigError

# Every failed call is counted as exactly one of these (fixed, so ranks can reduce the counts).
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "raised", "timeout", "sandbox", "too_many_calls")
ENVIRONMENT_HOOKS = ("reset", "get_reward", "close")  # environment methods that are not tools


@dataclass
class ParsedCall:
    """One tool call as the parser read it: a name and arguments, or the reason it is unreadable."""
    name: Optional[str]
    arguments: Optional[dict]
    error: Optional[str] = None


@dataclass
class ToolResult:
    name: str
    content: str
    error_kind: Optional[str]  # None for a call that worked, else one of ERROR_KINDS
    seconds: float


class ToolFailure(Exception):
    """A tool's own failure with its kind (ERROR_KINDS), e.g. a sandboxed program that timed out."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# ---- parsing ------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes(text: str) -> list[ParsedCall]:
    """Hermes/Qwen-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in
    order. `arguments` may be an object or a JSON string holding one."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            calls.append(ParsedCall(None, None, f"malformed tool call JSON ({str(e)[:80]})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParsedCall(None, None, 'a tool call is a JSON object {"name": ..., "arguments": {...}}'))
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(arguments, dict):
            calls.append(ParsedCall(obj["name"], None, "'arguments' must be a JSON object"))
            continue
        calls.append(ParsedCall(obj["name"], arguments))
    if text.count("<tool_call>") > len(calls):
        calls.append(ParsedCall(None, None, "<tool_call> without its closing </tool_call>"))
    return calls


PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {"hermes": hermes}


def resolve_parser(name: str) -> Callable[[str], list[ParsedCall]]:
    return PARSERS[name] if name in PARSERS else resolve_dotted(name, "rollout.tool_call_parser")


# ---- tools ----------------------------------------------------------------------------------------

@dataclass
class Tool:
    name: str
    schema: dict                    # {"type": "function", "function": {name, description, parameters}}
    call: Callable                  # call(arguments: dict, environment) -> str
    timeout_s: float


def function_schema(fn, what: str) -> dict:
    """transformers' JSON schema of a function from its type hints and Google-style docstring."""
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types here
        raise ConfigError(f"{what}: no tool schema for {getattr(fn, '__qualname__', fn)}: {e}. A tool needs "
                          "type hints on every argument and a docstring with an Args: section") from None


PYTHON_SCHEMA = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox and return what it prints (or its error).",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "the program; print the result"}},
        "required": ["code"]}}}


class PythonTool:
    """The built-in `python` tool: each call is a fresh sandboxed program (megagrpo/sandbox)."""

    def __init__(self, args: dict, workers: int):
        from megagrpo.sandbox import Sandbox, SandboxLimits
        args = dict(args)
        mode = args.pop("mode", "auto")
        known = set(SandboxLimits.__dataclass_fields__)
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"rollout.tools python: unknown args {unknown}; valid: mode, {', '.join(sorted(known))}")
        # refuses, naming the way out, where `mode` cannot run (a ConfigError: one line, no traceback)
        self.sandbox = Sandbox(SandboxLimits(**{"timeout_s": 5.0, "memory_mb": 512, **args}), mode=mode,
                               setting="rollout.tools python args.mode")
        self.sandbox.announce("python tool")
        self.slots = threading.BoundedSemaphore(max(1, workers))

    def __call__(self, arguments: dict, environment=None) -> str:
        with self.slots:
            result = self.sandbox.run(arguments["code"])
        if result.ok:
            return result.stdout
        kind = {"error": "raised", "timeout": "timeout"}.get(result.status, "sandbox")
        printed = result.stdout.strip()
        raise ToolFailure(kind, f"the program failed ({result.status}): {result.reason}"
                          + (f"\nit printed: {printed}" if printed else ""))

    def close(self) -> None:
        self.sandbox.close()


def function_tool(name: str, timeout_s: float, what: str) -> Tool:
    """The tool of a `module:function` entry, its schema from the function."""
    fn = resolve_dotted(name, what)
    if not callable(fn):
        raise ConfigError(f"{what}: '{name}' is not a function")
    schema = function_schema(fn, what)
    return Tool(schema["function"]["name"], schema, lambda arguments, environment=None: fn(**arguments), timeout_s)


def environment_failure(what: str, error: Exception) -> str:
    """A trajectory's failure when its environment's `what` raised: one line, its reason."""
    first_line = (str(error).splitlines() or [""])[0][:300]
    return f"environment: {what} raised {type(error).__name__}: {first_line}"


def resolve_environment(name: str):
    """The environment class rollout.environment names: module:Class, or hub:environment
    (megagrpo/hubs, e.g. textarena:GuessTheNumber-v0)."""
    from megagrpo.hubs import hub_environment, hub_of
    if hub_of(name):
        return hub_environment(name)
    cls = resolve_dotted(name, "rollout.environment")
    if not inspect.isclass(cls):
        raise ConfigError(f"rollout.environment: '{name}' is not a class")
    return cls


def environment_tools(cls, timeout_s: float) -> list[Tool]:
    """A tool per public method of an environment class (not reset/get_reward/close), called on
    the trajectory's own instance."""
    tools = []
    for name, _ in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in ENVIRONMENT_HOOKS:
            continue
        schema = function_schema(_without_self(getattr(cls, name)), f"rollout.environment method {name}")
        call = (lambda n: lambda arguments, environment: getattr(environment, n)(**arguments))(name)
        tools.append(Tool(name, schema, call, timeout_s))
    return tools


class Toolset:
    """The tools of a run: their schemas (for the chat template), their calls, and the
    environment class whose instances (one per trajectory) own the environment's tools."""

    def __init__(self, cfg):
        r = cfg.rollout
        check_unique_names(tool_names(cfg))  # before a sandbox starts
        self.tools: dict[str, Tool] = {}
        self.closers = []
        for i, t in enumerate(r.tools):
            if t.name == "python":
                python = PythonTool(t.args, r.tool_workers)
                self.closers.append(python.close)
                tool = Tool("python", PYTHON_SCHEMA, python, python.sandbox.limits.timeout_s + 5.0)
            else:
                tool = function_tool(t.name, r.tool_timeout_s, f"rollout.tools[{i}] ({t.name})")
            self.tools[tool.name] = tool
        self.environment_class = resolve_environment(r.environment) if r.environment else None
        if self.environment_class is not None:
            for tool in environment_tools(self.environment_class, r.tool_timeout_s):
                self.tools[tool.name] = tool

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def new_environment(self, fields: dict) -> tuple[object, str]:
        """A fresh environment instance for one trajectory, reset with the row's fields (or None),
        and the reason it failed to start ("" when it did: a failed one is None)."""
        if self.environment_class is None:
            return None, ""
        try:
            environment = self.environment_class()
            reset = getattr(environment, "reset", None)
            if callable(reset):
                reset(**fields)
        except Exception as e:  # noqa: BLE001 - the environment's own failure ends its episode, not the run
            return None, environment_failure("reset", e)
        return environment, ""

    def close(self) -> None:
        for close in self.closers:
            close()


def check_tools(cfg) -> None:
    """Config check, before anything is built: the multi-turn settings fit together, every
    function tool and the environment import and have a schema, the parser resolves."""
    from megagrpo.hubs import runs_as_outside_agent
    r = cfg.rollout
    outside = bool(r.agent or r.agent_command or runs_as_outside_agent(r.environment))
    agentic = bool(r.tools or r.environment) and not outside  # the built-in loop's tools
    if r.max_turns < 1:
        raise ConfigError(f"rollout.max_turns: {r.max_turns} must be >= 1 (1: single-turn)")
    if agentic and r.max_turns < 2:
        raise ConfigError(f"rollout.max_turns: {r.max_turns} leaves no turn to read a tool's result; set "
                          "rollout.max_turns >= 2 with rollout.tools or rollout.environment")
    if r.max_turns > 1 and not agentic and not outside:
        raise ConfigError(f"rollout.max_turns: {r.max_turns} needs rollout.tools or rollout.environment "
                          "(a turn continues only after tool calls), e.g. rollout.tools=[python]")
    for key in ("tool_timeout_s", "max_tool_response_tokens", "max_tool_calls_per_turn", "tool_workers"):
        if getattr(r, key) <= 0:
            raise ConfigError(f"rollout.{key}: {getattr(r, key)} must be > 0")
    if not agentic:
        return
    resolve_parser(r.tool_call_parser)
    names = tool_names(cfg)
    if r.environment and not names:
        raise ConfigError(f"rollout.environment: {r.environment} has no public method to offer as a tool")
    check_unique_names(names)


def tool_names(cfg) -> list[tuple[str, str]]:
    """[(name, where it comes from)] of every tool of the run, in order, without starting any
    (the python tool's name is fixed; a function's and an environment method's come from
    their schemas)."""
    r = cfg.rollout
    names = []
    for i, t in enumerate(r.tools):
        what = f"rollout.tools[{i}] ({t.name})"
        name = "python" if t.name == "python" else function_tool(t.name, r.tool_timeout_s, what).name
        names.append((name, what))
    if r.environment:
        names += [(tool.name, f"rollout.environment method {tool.name}")
                  for tool in environment_tools(resolve_environment(r.environment), r.tool_timeout_s)]
    return names


def check_unique_names(names: list[tuple[str, str]]) -> None:
    """ConfigError at the second of two tools with one name (the chat template and the calls
    address tools by name)."""
    seen = {}
    for name, what in names:
        if name in seen:
            raise ConfigError(f"{what}: more than one tool named {name} (also {seen[name]}); "
                              "tool names must be unique")
        seen[name] = what


def _without_self(method):
    """An unbound method as a function of its other arguments, for its schema."""
    signature = inspect.signature(method)
    params = list(signature.parameters.values())[1:]

    def stand_in(*args, **kwargs):
        raise NotImplementedError

    stand_in.__name__, stand_in.__doc__ = method.__name__, method.__doc__
    stand_in.__signature__ = signature.replace(parameters=params)
    stand_in.__annotations__ = {k: v for k, v in getattr(method, "__annotations__", {}).items() if k != "self"}
    return stand_in


# ---- running calls ---------------------------------------------------------------------------------

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def check_arguments(schema: dict, arguments: dict) -> Optional[str]:
    """Why `arguments` do not fit the tool's schema (missing, unexpected, wrong JSON type), or None."""
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unexpected = [k for k in arguments if k not in properties]
    if unexpected:
        return f"unexpected argument(s) {', '.join(unexpected)}; it takes {', '.join(properties) or 'none'}"
    for key, value in arguments.items():
        kind = properties[key].get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        types = tuple(t for k in kinds if k in _JSON_TYPES for t in
                      (_JSON_TYPES[k] if isinstance(_JSON_TYPES[k], tuple) else (_JSON_TYPES[k],)))
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"argument '{key}' must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


class ToolRunner:
    """Runs the calls of one turn: the calls of different trajectories concurrently, the calls
    of one trajectory in order (its environment sees them in the order the model wrote them).
    Each call runs on a thread and is waited for at most its tool's timeout; a function that
    never returns is left running on its (daemon) thread and reported as a timeout."""

    def __init__(self, toolset: Toolset, max_calls_per_turn: int):
        self.toolset, self.max_calls = toolset, max_calls_per_turn

    def run(self, jobs: list[tuple[list[ParsedCall], object]]) -> list[list[ToolResult]]:
        """jobs: per trajectory, its parsed calls and its environment (or None)."""
        results: list[list[ToolResult]] = [[] for _ in jobs]
        for wave in range(max((len(calls) for calls, _ in jobs), default=0)):
            running = []
            for i, (calls, environment) in enumerate(jobs):
                if wave < len(calls):
                    slot: list = []
                    call = calls[wave]
                    if wave >= self.max_calls:
                        slot.append(ToolResult(call.name or "?", f"error: more than {self.max_calls} tool calls "
                                               "in one turn; this one was not run", "too_many_calls", 0.0))
                        running.append((i, call, None, slot, 0.0))
                        continue
                    thread = threading.Thread(target=lambda c=call, e=environment, s=slot: s.append(self._call(c, e)),
                                              daemon=True, name="megagrpo-tool")
                    thread.start()
                    running.append((i, call, thread, slot, time.perf_counter()))
            for i, call, thread, slot, started in running:
                if thread is not None:
                    tool = self.toolset.tools.get(call.name or "")
                    thread.join(max(0.0, (tool.timeout_s if tool else 1.0) - (time.perf_counter() - started)))
                    if thread.is_alive() or not slot:
                        slot[:] = [ToolResult(call.name, f"error: {call.name} timed out after {tool.timeout_s:g} s",
                                              "timeout", time.perf_counter() - started)]
                results[i].append(slot[0])
        return results

    def _call(self, call: ParsedCall, environment) -> ToolResult:
        start = time.perf_counter()

        def result(content: str, kind: Optional[str] = None) -> ToolResult:
            return ToolResult(call.name or "?", content, kind, time.perf_counter() - start)

        if call.error:
            return result(f"error: {call.error}", "parse")
        tool = self.toolset.tools.get(call.name)
        if tool is None:
            return result(f"error: unknown tool '{str(call.name)[:60]}'; the tools are "
                          f"{', '.join(self.toolset.tools)}", "unknown_tool")
        problem = check_arguments(tool.schema, call.arguments)
        if problem:
            return result(f"error: wrong arguments for {tool.name}: {problem}", "bad_arguments")
        try:
            value = tool.call(call.arguments, environment)
        except ToolFailure as e:
            return result(f"error: {e}", e.kind)
        except Exception as e:  # noqa: BLE001 - a tool that raises is the model's error to read
            return result(f"error: {tool.name} raised {type(e).__name__}: {str(e)[:300]}", "raised")
        return result(value if isinstance(value, str) else json.dumps(value, default=str))
