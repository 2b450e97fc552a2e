"""The package map holds: checkpoint/ is below training/ and convert/, which do not import
each other, and no module imports itself back through others. Read from the source (ast), so
a new violation fails here rather than in review."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rembert"
# training/ and convert/ read the run's YAML through run_config, which imports neither.
CONFIG_SCHEMA = "megatron_rembert.run_config"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every megatron_rembert module -> the megatron_rembert modules it imports (anywhere in
    the file, function-level imports included)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level
                                                       + 1] + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m.startswith("megatron_rembert")}
    modules = set(graph)
    return {k: {m for m in v if m in modules} for k, v in graph.items()}


def _in(module: str, package: str) -> bool:
    return module == f"megatron_rembert.{package}" or module.startswith(
        f"megatron_rembert.{package}.")


def test_layering_between_checkpoint_training_and_convert():
    graph = _imports()
    bad = []
    for module, targets in graph.items():
        for target in targets:
            if _in(module, "checkpoint") and (_in(target, "training") or _in(target, "convert")):
                bad.append(f"{module} -> {target}")
            if _in(module, "training") and _in(target, "convert"):
                bad.append(f"{module} -> {target}")
            if _in(module, "convert") and _in(target, "training"):
                bad.append(f"{module} -> {target}")
    leaf = [t for t in graph[CONFIG_SCHEMA]
            if _in(t, "training") or _in(t, "convert") or _in(t, "checkpoint")]
    assert not bad, "upward or sideways imports: " + ", ".join(sorted(bad))
    assert not leaf, f"{CONFIG_SCHEMA} must stay a leaf: imports {leaf}"


def test_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if target == module or target.startswith(module + "."):
                continue  # a package importing its own submodules is not a cycle
            if state.get(target) == 1 and not module.startswith(target + "."):
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(cycles)
