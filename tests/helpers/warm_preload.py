"""Imported by the tests' warm servers (warm_ranks.py, warm_jobs.py) before they fork: the
trainer's and vLLM's engine modules, and what importing them set in the environment."""
import importlib
import os

PRELOAD = ("megagrpo.train", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.qwen2")
BEFORE = dict(os.environ)
for _module in PRELOAD:
    importlib.import_module(_module)
SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if BEFORE.get(k) != v}  # vLLM's LD_LIBRARY_PATH, ...


def environment_after_imports(env: dict) -> dict:
    """`env` as these imports would have left it in a process started cold with it."""
    return {**env, **{k: v for k, v in SET_BY_IMPORTS.items() if env.get(k) == BEFORE.get(k)}}
