"""The package's shape: the layering the imports keep (docs/architecture.md), no import cycles, no
large modules (counted in lines of code), the generated configuration page up to date, lint."""
import ast
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megagrpo"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """megagrpo module -> the megagrpo modules it imports anywhere in its body (function-level
    imports count too: a lazy import does not make a cycle go away)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: -node.level + (path.name == "__init__.py") or None]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# The order of the packages (docs/architecture.md): each imports only those in layers before its
# own, never one of its layer or above. A module at the top of megagrpo/ is its own package.
LAYERS = [
    ("megagrpo", "dtypes", "console", "process_exit", "config", "run_logs"),  # megagrpo: the package's own __init__
    ("cluster",),
    ("sandbox",),
    ("algorithm", "multimodal", "hubs"),
    ("policy",),
    ("data",),
    ("rollout",),
    ("rewards",),
    ("checkpoints", "planning", "metrics", "monitoring", "stack"),
    ("doctor",),
    ("validation", "memory_fit", "rating"),
    ("evaluation", "report"),
    ("train",),
    ("cli", "hostfile"),
]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megagrpo"


def order_violations(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """'a -> b' for every import that runs against the order of the layers (or names a package
    that has no layer)."""
    layer = {package: i for i, names in enumerate(layers) for package in names}
    found = []
    for module, imports in sorted(graph.items()):
        here = package_of(module)
        if here not in layer:
            found.append(f"{module}: package '{here}' has no place in LAYERS")
            continue
        for target in sorted(imports):
            there = package_of(target)
            if there != here and layer.get(there, len(layers)) >= layer[here]:
                found.append(f"{module} -> {target}")
    return found


def test_imports_keep_the_order_of_the_layers():
    graph = import_graph()
    assert {package_of(m) for m in graph} >= {"config", "policy", "rollout", "sandbox", "train"}
    violations = order_violations(graph)
    assert not violations, "imports against the layering (docs/architecture.md):\n" + "\n".join(violations)


def test_the_order_check_finds_a_back_import():
    graph = import_graph()
    graph["megagrpo.config.loading"] = graph["megagrpo.config.loading"] | {"megagrpo.rewards"}
    assert order_violations(graph) == ["megagrpo.config.loading -> megagrpo.rewards"]
    assert order_violations({"megagrpo.policy.zero": {"megagrpo.algorithm.loss"}}) == []
    assert order_violations({"megagrpo.metrics": {"megagrpo.planning"}}) == ["megagrpo.metrics -> megagrpo.planning"]
    assert order_violations({"megagrpo.newpart": set()}) == [
        "megagrpo.newpart: package 'newpart' has no place in LAYERS"]


def code_lines(source: str) -> int:
    """The lines of `source` that hold code: not blank, not only a comment, not inside a docstring
    (any string statement: a module's, class's or function's docstring, a field's after it)."""
    docstrings = [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset))
                  for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip or (tok.type == tokenize.STRING and any(
                start <= tok.start and tok.end <= end for start, end in docstrings)):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def test_the_size_rule_counts_code_not_docstrings_or_comments():
    source = '''"""A module docstring,
on two lines."""
import os  # a comment after code


@dataclass
class Section:
    """A class docstring."""
    size: int = 1
    """A field's docstring,
    on two lines."""

    def path(self):  # the def counts
        # a comment alone
        return os.sep
    def one(self): """a docstring on its def's line"""


TEMPLATE = """a string that is data,
not a docstring"""
'''
    # import, @dataclass, class, size, def path, return, def one, TEMPLATE's two lines
    assert code_lines(source) == 9
    assert code_lines("x = 1\n\n# one\n") == 1


def test_no_module_is_large():
    """400 lines of code a module (docstrings, comments and blank lines are not counted)."""
    sizes = {str(p.relative_to(ROOT)): code_lines(p.read_text()) for p in PACKAGE.rglob("*.py")}
    large = {path: n for path, n in sizes.items() if n > 400}
    assert not large, f"modules over 400 lines of code (split them by concern): {large}"


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "megagrpo.train" in graph and "megagrpo.policy" in graph["megagrpo.train"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_configuration_page_is_generated_from_the_schema():
    from megagrpo.config.docs import markdown
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == markdown(), ("docs/configuration.md is stale: run "
                                     "`megagrpo config --markdown > docs/configuration.md`")
    from megagrpo.config import aliases
    for key in ("grpo.kl_coef", "rollout.max_new_tokens", "parallel.pipeline_parallel_size", "output_dir"):
        assert f"`{key}`" in committed
    # every field of every section has its docstring on the page
    assert "|  |" not in committed.replace("| --- |", "")
    assert all(f"`{name}`" in committed for name in aliases.ALIASES)


def test_train_loop_has_no_layout_branch_and_knows_no_lora_or_zero():
    text = (PACKAGE / "train.py").read_text()
    branches = [line for line in text.splitlines()
                if re.search(r"\b(if|elif|else)\b.*(pipeline|pp_size|tp_size|PipelineLoss)", line)]
    assert not branches, f"layout branches in train.py (they belong to megagrpo/policy): {branches}"
    assert "PipelineLoss" not in text and "self.pipeline" not in text
    # ZeRO and LoRA live behind the policy too (its layout(), adapter_config, exports)
    for word in ("lora", "zero_stage", ".policy.module", "deepspeed_json"):
        assert word not in text, f"train.py knows {word!r}: ask the policy (megagrpo/policy/base.py) instead"
    assert code_lines(text) <= 350, "train.py over 350 lines of code: the loop belongs to its parts"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_readme_is_a_front_door_to_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 10
    missing = [name for name in pages if f"](docs/{name})" not in readme]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_openmp_threads_wait_passively_where_ranks_share_a_node():
    """`import megagrpo` sets OMP_WAIT_POLICY=PASSIVE before torch is loaded (libgomp reads it
    then, docs/cpu-stack.md) when a launcher started several ranks on the node; a lone process
    keeps libgomp's default; a value the user set stays."""
    code = ("import os, sys; import megagrpo; loaded = 'torch' in sys.modules; import torch; "
            "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), loaded)")
    launch = ("OMP_WAIT_POLICY", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
              "SLURM_NTASKS_PER_NODE", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    for extra, expected in (({}, "unset False"), ({"LOCAL_WORLD_SIZE": "2"}, "PASSIVE False"),
                            ({"LOCAL_SIZE": "2"}, "PASSIVE False"),
                            ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "unset False"),
                            ({"WORLD_SIZE": "4"}, "PASSIVE False"),
                            ({"LOCAL_WORLD_SIZE": "2", "OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE False")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**env, **extra})
        assert proc.stdout.split() == expected.split(), (extra, proc.stderr[-2000:])


def unsafe_loads(source: str, where: str) -> list[str]:
    """Every torch.load in `source` that could unpickle more than tensors and plain data: one
    without weights_only=True, and any safe_globals naming a class of megagrpo's own (a checkpoint
    may come from another cluster or user; ours are saved as JSON and tensors instead)."""
    tree, found = ast.parse(source), []
    ours = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and (n.level or (n.module or "").startswith("megagrpo")) for a in n.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name.endswith("torch.load") or name == "load" and "from torch import load" in source:
            flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (needs weights_only=True)")
        if name.endswith("safe_globals") or name.endswith("add_safe_globals"):
            named = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
            if named & ours:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (unpickles megagrpo's own classes)")
    return found


def test_no_load_unpickles_more_than_data():
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in unsafe_loads(p.read_text(), p.relative_to(ROOT))]
    assert not found, "loads that unpickle objects:\n" + "\n".join(found)
    assert unsafe_loads("import torch\ntorch.load(p, weights_only=False)", "a") == [
        "a:2: torch.load(p, weights_only=False) (needs weights_only=True)"]
    assert unsafe_loads("import torch\ntorch.load(p)", "a") == ["a:2: torch.load(p) (needs weights_only=True)"]
    assert unsafe_loads("from megagrpo.rollout.ahead import AheadBatch\nimport torch\n"
                        "with torch.serialization.safe_globals([AheadBatch]):\n    torch.load(p, weights_only=True)",
                        "a") == [
        "a:3: torch.serialization.safe_globals([AheadBatch]) (unpickles megagrpo's own classes)"]
    assert unsafe_loads("from deepspeed import LossScaler\nimport torch\n"
                        "torch.serialization.add_safe_globals([LossScaler])", "a") == []
