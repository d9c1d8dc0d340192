"""An agent written against the `openai` SDK, as a user writes one, for the outside-agent tests
and bench (megagrpo/rollout/outside_agents.py): it sends the task's messages with a `python`
tool, runs the calls the model makes itself (arithmetic programs only: `print(<expression>)`),
sends the results back, and stops at a turn without a call or after MAX_TURNS model calls.

    solve(base_url=..., api_key=..., model=..., task=...)   # rollout.agent=openai_tool_agent:solve
    python tests/helpers/openai_tool_agent.py [mode]        # rollout.agent_command (the environment's)

Its result is {"reward": 1.0} when its last answer holds the row's answer, else 0.0.

Modes, for the tests:
  - stream: every other call streams;
  - rerender: every earlier assistant message is sent back reworded (a prefix mismatch the
    endpoint must count and survive);
  - chaos (a command): its episodes take turns (counted in $AGENT_ERRORS.count) to crash, hang,
    end without calling the model, first send a malformed request and one for another model
    (their error bodies are appended to $AGENT_ERRORS) and then run as usual, or just run.
"""
import ast
import json
import operator
import os
import sys
import time
import urllib.error
import urllib.request

MAX_TURNS = 3
# the agent's own copy of megagrpo's PYTHON_SCHEMA (rollout/tools.py), the tool the quickstart's warm start
# learned: as a user's agent it imports nothing of megagrpo, and its processes start 0.3 s sooner for it
PYTHON = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox and return what it prints (or its error).",
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "the program; print the result"}},
        "required": ["code"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
             ast.Mod: operator.mod, ast.USub: operator.neg}


def arithmetic(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](arithmetic(node.operand))
    raise ValueError("only integer arithmetic")


def run_python(code: str) -> str:
    """What `print(<integer arithmetic>)` prints; an error line for anything else."""
    try:
        call = ast.parse(code.strip(), mode="eval").body
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print" and len(call.args) == 1):
            raise ValueError("the program must be print(<expression>)")
        return f"{arithmetic(call.args[0])}\n"
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"Error: {e}\n"


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (or its error).

    Args:
        code: the program; print the result
    """
    return run_python(code)  # the same tool as a megagrpo function tool, for bench/outside_agents.py


def solve(base_url: str, api_key: str, model: str, task: dict, mode: str = "") -> dict:
    # imported here, not at the top: a chaos episode takes its number before the second of CPU that
    # openai's import costs, so on a loaded machine a timeout cannot come before the count and shift fates
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages, answer = list(task["messages"]), ""
    for turn in range(MAX_TURNS):
        sent = [{**m, "content": m["content"] + " (as sent)"} if "rerender" in mode and m["role"] == "assistant"
                else m for m in messages]
        if "stream" in mode and turn % 2:
            message = streamed(client, model, sent)
        else:
            message = client.chat.completions.create(model=model, messages=sent, tools=[PYTHON]).choices[0].message
            message = message.model_dump(exclude_none=True)
        messages.append(message)
        answer = message.get("content") or ""
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            output = run_python(arguments.get("code", ""))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    expected = str(task["fields"].get("answer", ""))
    return {"reward": 1.0 if expected and expected in answer else 0.0}


def solve_streaming(**task) -> dict:
    return solve(**task, mode="stream")


def solve_streaming_rerendering(**task) -> dict:
    return solve(**task, mode="stream rerender")


def streamed(client, model: str, messages: list) -> dict:
    """One streamed turn, its chunks put together as the SDK's users do."""
    content, calls = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=[PYTHON], stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def bad_requests(base_url: str, model: str) -> list:
    """A malformed body and a request for another model: the endpoint's error bodies."""
    bodies = []
    for data in (b'{"model": "' + model.encode() + b'", "messages": [', json.dumps(
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode()):
        request = urllib.request.Request(f"{base_url}/chat/completions", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=30)
            bodies.append({"status": 200})
        except urllib.error.HTTPError as e:
            bodies.append({"status": e.code, "body": json.loads(e.read())})
    return bodies


def next_turn(path: str) -> int:
    """A counter shared by the episodes' processes (under a lock): this episode's number."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        count = len(f.read())
        f.write(".")
        return count


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    task = json.loads(sys.stdin.read())
    base_url, model = os.environ["OPENAI_BASE_URL"], os.environ["MEGAGRPO_MODEL"]
    if mode == "chaos":
        fate = next_turn(os.environ["AGENT_ERRORS"] + ".count") % 5
        if fate == 0:
            raise SystemExit("chaos: this agent crashes")
        if fate == 1:
            time.sleep(3600)
        if fate == 2:
            print(json.dumps({"reward": 1.0}))  # claims a reward without calling the model
            return 0
        if fate == 3:
            with open(os.environ["AGENT_ERRORS"], "a") as f:
                f.write(json.dumps(bad_requests(base_url, model)) + "\n")
    print(json.dumps(solve(base_url, os.environ["OPENAI_API_KEY"], model, task)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
