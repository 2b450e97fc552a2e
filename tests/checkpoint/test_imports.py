"""The package map holds (README, "Architecture"): every arrow between modules and between
packages points down, floor by floor, and no module imports itself back through others. Read
from the source (ast), function-level imports included, so a new violation fails here rather
than in review."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rembert"

# Each top-level module or package of megatron_rembert on its floor, lowest first. A module
# may import only from lower floors (or its own package): units on one floor are peers that
# never import each other (kernels/ and parallel/ are not: a kernel computes on one shard, the
# collectives around it live in parallel/, so kernels/ sits below and never imports it).
FLOORS = (
    ("errors", "fs"),  # the ground floor: import nothing of the package
    ("config", "cli", "launch_env", "deepspeed_env"),  # ModelConfig and ranges; what command
    # lines share; the launcher's variables; DeepSpeed's environment (its accelerator, quiet)
    ("kernels",),
    ("parallel",),
    ("data",),  # training-time data path: shards, sampler, masking, batch schema, loader
    ("run_config",),  # the run's YAML: imports data.config, data.schedule, parallel.layout
    ("prep", "model"),  # offline data preparation; the model (and model.retrieval: the
    # pooling and accuracy@1 that both the trainer's retrieval and eval/ compute)
    ("checkpoint",),  # below both training/ and convert/
    ("training", "convert"),  # peers: neither imports the other
    ("eval",),  # evaluation: reads checkpoints (checkpoint/, convert/'s mapping), builds model/
    ("train", "summary", "plot"),  # entry points: parse, build, call
)
# What prep/ may take from data/: the shard format it writes and the sampling law that the
# tokenizer's language sampling and the inspection's sampling table share with training.
PREP_USES_FROM_DATA = {"data.shards", "data.common", "data.sampler", "data.schedule",
                       "data.config"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _raw_imports() -> dict[str, set[str]]:
    """Every megatron_rembert module -> every module name it imports (anywhere in the file,
    function-level imports included), ours and others'."""
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
        graph[name] = found
    return graph


def _imports() -> dict[str, set[str]]:
    """Every megatron_rembert module -> the megatron_rembert modules it imports."""
    raw = _raw_imports()
    return {k: {m for m in v if m in raw} for k, v in raw.items()}


def _unit(module: str) -> str:
    """The top-level module or package a module belongs to ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _short(module: str) -> str:
    return module.removeprefix("megatron_rembert.")


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in _imports()} - {""}
    assert not units - set(FLOOR), f"add to FLOORS: {sorted(units - set(FLOOR))}"


def test_arrows_point_down_between_packages():
    bad = []
    for module, targets in _imports().items():
        for target in targets:
            a, b = _unit(module), _unit(target)
            if a != b and "" not in (a, b) and FLOOR[b] >= FLOOR[a]:
                side = "sideways" if FLOOR[b] == FLOOR[a] else "upward"
                bad.append(f"{_short(module)} -> {_short(target)} ({side})")
    assert not bad, "imports that do not point down: " + ", ".join(sorted(bad))


def test_ground_floor_imports_nothing_of_the_package_nor_torch():
    raw = _raw_imports()
    for unit in FLOORS[0] + ("cli",):
        module = f"megatron_rembert.{unit}"
        if module not in raw:
            continue
        ours = {m for m in raw[module] if m.startswith("megatron_rembert")}
        if unit in FLOORS[0]:
            assert not ours, f"{unit} imports {sorted(ours)}"
        assert not {m for m in raw[module] if m.split(".")[0] in ("torch", "numpy")}, unit


def test_no_package_cycle():
    edges: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        for target in targets:
            if _unit(module) != _unit(target) and "" not in (_unit(module), _unit(target)):
                edges.setdefault(_unit(module), set()).add(_unit(target))
    cycles = []

    def visit(unit: str, path: list[str]) -> None:
        for target in sorted(edges.get(unit, ())):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            else:
                visit(target, path + [target])

    for unit in sorted(edges):
        visit(unit, [unit])
    assert not cycles, "package cycles: " + "; ".join(sorted(set(cycles)))


def test_data_path_never_reaches_torch_distributed():
    """data/ and everything it imports, transitively: ranks and sizes are passed in."""
    raw, ours = _raw_imports(), _imports()
    seen, todo = set(), [m for m in ours if _unit(m) == "data"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(ours[module])
    bad = {f"{_short(m)} -> {t}" for m in seen for t in raw[m]
           if t.startswith(("torch.distributed", "deepspeed"))}
    assert not bad, f"the data path imports torch.distributed or DeepSpeed: {sorted(bad)}"


def test_prep_takes_only_the_shard_format_and_the_sampling_law_from_data():
    bad = {f"{_short(m)} -> {_short(t)}" for m, targets in _imports().items()
           if _unit(m) == "prep" for t in targets
           if _unit(t) == "data" and _short(t) not in PREP_USES_FROM_DATA | {"data"}}
    assert not bad, f"prep/ reaches into the training-time data path: {sorted(bad)}"


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
