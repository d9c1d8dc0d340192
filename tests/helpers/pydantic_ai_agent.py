"""An agent written with pydantic-ai (an agent framework people use; `pydantic-ai-slim[openai]`
is in the test extra), for tests/test_outside_agents.py: its OpenAI model pointed at the
endpoint's base URL, the arithmetic `python` tool of openai_tool_agent.py as a pydantic-ai tool,
at most 3 model requests (an episode that spends them all on tool calls ends unanswered, as a
budget-aware agent does, and scores 0). Its result is pydantic-ai's own output (the last answer's text) held
against the row's answer."""
from openai_tool_agent import run_python
from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits


def solve(base_url: str, api_key: str, model: str, task: dict) -> dict:
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key=api_key)))

    @agent.tool_plain
    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints (or its error).

        Args:
            code: the program; print the result
        """
        return run_python(code)

    try:
        result = agent.run_sync(task["messages"][-1]["content"], usage_limits=UsageLimits(request_limit=3))
    except UsageLimitExceeded:  # its 3 requests spent on tool calls, no answer given: it scores 0
        return {"reward": 0.0}
    expected = str(task["fields"].get("answer", ""))
    return {"reward": 1.0 if expected and expected in str(result.output) else 0.0}


def python_on_some_turns(text: str):
    """The test's parser: a turn whose characters' codes sum to an even number calls python (its
    program predictable from the turn, as agent_tools.python_call), any other answers."""
    from agent_tools import python_parser

    return python_parser(text) if sum(map(ord, text)) % 2 == 0 else []
