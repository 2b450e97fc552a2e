"""The launcher's variables are read once (launch_env.launch_env, into the run plan) and
written by one function (launch_env.publish): no other module of the package touches them in
os.environ. The modules are found from the source (every .py file of the package, parsed with
ast, function-level code included), not from a list."""

import ast
import os
import textwrap
from pathlib import Path

import pytest

from megatron_rembert import launch_env as launch_module
from megatron_rembert.launch_env import LaunchEnv, launch_env, publish

PACKAGE = Path(launch_module.__file__).resolve().parent
# Every variable of these launchers' families is the launcher's, whether launch_env reads it
# or not (torchrun / torchelastic, SLURM, MPI).
FAMILIES = ("SLURM_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "MASTER_")
OTHERS = {"GROUP_RANK", "ROLE_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"}


def is_launcher(name: str | None) -> bool:
    """None (a key not written in the source, or the whole environment) counts as one."""
    return (name is None or name in launch_module.READS or name in OTHERS
            or name.startswith(FAMILIES))


def _constant(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def environment_uses(source: str) -> list[tuple[int, str | None]]:
    """(line, variable) for every read or write of the process environment in `source`:
    os.environ[...] / .get / .setdefault / .pop / .update / `in`, os.getenv / putenv /
    unsetenv, and `environ` / `getenv` imported from os. The variable is None where the source
    does not name it (a computed key, or the whole environment handed on)."""
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    from_os = {a.asname or a.name: a.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "os" for a in node.names}

    def named(node: ast.AST, name: str) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == name
                 and isinstance(node.value, ast.Name) and node.value.id == "os")
                or (isinstance(node, ast.Name) and from_os.get(node.id) == name))

    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(named(node.func, f)
                                              for f in ("getenv", "putenv", "unsetenv")):
            uses.append((node.lineno, _constant(node.args[0]) if node.args else None))
        if not named(node, "environ") or isinstance(parent.get(node), ast.ImportFrom):
            continue
        up = parent.get(node)
        if isinstance(up, ast.Subscript) and up.value is node:
            uses.append((node.lineno, _constant(up.slice)))
        elif isinstance(up, ast.Compare) and isinstance(up.ops[0], ast.In | ast.NotIn):
            uses.append((node.lineno, _constant(up.left)))
        elif (isinstance(up, ast.Attribute) and isinstance(parent.get(up), ast.Call)
              and up.attr == "update"):
            call = parent[up]
            keys = [k.arg for k in call.keywords]
            for arg in call.args:
                keys += ([_constant(k) for k in arg.keys] if isinstance(arg, ast.Dict)
                         else [None])
            uses += [(node.lineno, key) for key in keys]
        elif isinstance(up, ast.Attribute) and isinstance(parent.get(up), ast.Call):
            args = parent[up].args
            uses.append((node.lineno, _constant(args[0]) if args else None))
        else:
            uses.append((node.lineno, None))  # the whole environment, handed on
    return sorted(uses, key=lambda use: use[0])


def launcher_uses(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} {name or '(unnamed)'}"
            for line, name in environment_uses(path.read_text()) if is_launcher(name)]


def test_no_module_but_launch_env_reads_or_writes_the_launchers_variables():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50 and PACKAGE / "launch_env.py" in files
    found = [use for path in files if path.name != "launch_env.py" or path.parent != PACKAGE
             for use in launcher_uses(path)]
    assert found == [], ("the launcher's variables are read by launch_env.launch_env (once, "
                         "into the run plan) and written by launch_env.publish only: "
                         + "; ".join(found))
    # ... and the scan does see launch_env's own reading and writing
    assert launcher_uses(PACKAGE / "launch_env.py")


def test_the_scan_finds_every_way_of_touching_the_environment():
    source = textwrap.dedent("""
        import os
        from os import environ as env, getenv
        a = os.environ["RANK"]
        b = os.environ.get("SLURM_JOB_ID", "")
        c = os.getenv("WORLD_SIZE")
        d = "LOCAL_RANK" in os.environ
        os.environ.update(MASTER_ADDR="x", OMP_NUM_THREADS="1")
        os.environ.update({"MASTER_PORT": "1"})
        e = dict(os.environ)
        f = env["SLURM_PROCID"]
        g = getenv("TORCHELASTIC_RUN_ID")
        os.environ["LOCAL_RANK"] = "0"
        key = "RANK"
        h = os.environ[key]
        fine = os.environ.get("OMP_NUM_THREADS"), os.getenv("TORCH_EXTENSIONS_DIR")
    """)
    uses = environment_uses(source)
    flagged = [(line, name) for line, name in uses if is_launcher(name)]
    assert [name for _, name in flagged] == [
        "RANK", "SLURM_JOB_ID", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", None,
        "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", None]
    assert sorted(name for _, name in uses if not is_launcher(name)) == [
        "OMP_NUM_THREADS", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR"]


@pytest.fixture
def clean_launcher(monkeypatch):
    """No launcher variable set (an empty value counts as unset); restored afterwards."""
    for name in launch_module.READS:
        monkeypatch.setenv(name, "")


def test_publish_writes_what_launch_env_reads_back(clean_launcher):
    assert launch_env() == LaunchEnv()  # one process: rank 0, no world size
    publish(LaunchEnv())
    assert {n: os.environ[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                       "MASTER_PORT")} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500"}
    launch = LaunchEnv(rank=3, world_size=4, local_rank=1, master_addr="node7",
                       master_port=1234)
    publish(launch)
    assert launch_env() == launch
    publish(launch, local_rank=0)  # the GPU this rank uses, for DeepSpeed
    assert os.environ["LOCAL_RANK"] == "0" and launch_env().rank == 3


def test_launch_env_reads_the_slurm_job_and_the_rendezvous(clean_launcher, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", " 4711 ")
    monkeypatch.setenv("MASTER_ADDR", "node3")
    monkeypatch.setenv("MASTER_PORT", "2222")
    launch = launch_env()
    assert (launch.slurm_job_id, launch.master_addr, launch.master_port) == ("4711", "node3",
                                                                            2222)
    monkeypatch.setenv("MASTER_PORT", "")
    assert launch_env(default_port=29593).master_port == 29593
