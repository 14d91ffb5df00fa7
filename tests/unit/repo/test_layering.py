"""Which package may import which (docs/architecture.md): checked on the source, so it stays true.

    flows/    the pipeline's shape (Prefect flows, CLI); may import everything
    tasks/    the stages' plain logic; may import storage/, models/, infra/ and, of flows/, only the config
    storage/  tables and object stores  \
    models/   model code and loading     } never import tasks/; of flows/, only the config
    infra/    processes and places       /  and never models/: models/ sits above infra/ (the embedded engine,
                                            models/engine/, runs the models; infra/ only starts it as a process)
    flows/config/ imports nothing of the project but the error type (infra/errors.py) and plugin loading
    (infra/plugins.py); infra's leaf modules (errors, proc, cache) import nothing of the project.
    infra/ imports nothing of flows/, not even the config (it takes plain values: infra/engine_fleet.py).

No two project modules import each other round a circle. A trainer imports training: neither the trainer nor a
rank's entry point can reach Delta Lake, Prefect, FastAPI or s3fs (so a rank runs where only training's
dependencies are), checked on the source and in a fresh interpreter.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import import_graph as graph
import pytest
from paths import ROOT

ROOT = ROOT
PACKAGES = ("flows", "tasks", "storage", "models", "infra")


def project_imports(path: Path) -> set[str]:
    """Every `sluiceway.*` module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n == "sluiceway" or n.startswith("sluiceway.")}
    return found


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def test_the_import_parser_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom sluiceway.flows import cli\n\ndef g():\n    from sluiceway.flows.rl import rl_flow\n")
    assert project_imports(f) == {"sluiceway.flows", "sluiceway.flows.rl"}


@pytest.mark.parametrize("package", ["tasks", "storage", "models", "infra"])
def test_below_flows_only_the_config_is_imported(package):
    bad = {
        f"{p.relative_to(ROOT)} imports {m}"
        for p in modules(package)
        for m in project_imports(p)
        if m.startswith("sluiceway.flows") and not is_config(m)
    }
    assert not bad, sorted(bad)


@pytest.mark.parametrize("package", ["storage", "models", "infra"])
def test_lower_layers_never_import_the_stages(package):
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in modules(package) for m in project_imports(p)
           if m.startswith("sluiceway.tasks")}  # fmt: skip
    assert not bad, sorted(bad)


def is_config(module: str) -> bool:
    return module == "sluiceway.flows.config" or module.startswith("sluiceway.flows.config.")


def test_config_imports_nothing_of_the_project_but_the_error_type_and_plugin_loading():
    # plugins: --custom-tis-function-path is imported and checked when the config is read; it needs only errors.
    # prompt_sources: the kinds of prompt source by scheme, plain data that imports nothing of the project.
    allowed = {"sluiceway.infra.errors", "sluiceway.infra.plugins", "sluiceway.infra.prompt_sources"}
    parts = modules("flows/config")
    assert ROOT / "flows" / "config" / "__init__.py" in parts and len(parts) > 1
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in parts for m in project_imports(p)
           if not is_config(m) and m not in allowed}  # fmt: skip
    assert not bad, sorted(bad)
    outside = {m for p in parts for m in project_imports(p) if not is_config(m)}
    assert outside == allowed
    assert project_imports(ROOT / "infra" / "plugins.py") == {"sluiceway.infra.errors"}
    assert project_imports(ROOT / "infra" / "prompt_sources.py") == set()


def test_infra_never_imports_models():
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in modules("infra") for m in project_imports(p)
           if m.startswith("sluiceway.models")}  # fmt: skip
    assert not bad, sorted(bad)


def test_infra_never_imports_the_flows():
    # Not even the config: what a process needs of it comes as plain values (infra/engine_fleet.py: FleetSettings).
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in modules("infra") for m in project_imports(p)
           if m.startswith("sluiceway.flows")}  # fmt: skip
    assert not bad, sorted(bad)


@pytest.mark.parametrize("leaf", ["infra/errors.py", "infra/proc.py", "infra/cache.py"])
def test_leaf_modules_import_nothing_of_the_project(leaf):
    assert project_imports(ROOT / leaf) == set()


def test_every_package_is_checked():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} >= set(PACKAGES)


# ---------------------------------------------------------------------------------------------------------- circles
def test_the_graph_sees_each_kind_of_import():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\nclass K:\n    import d\n"
                     "def f():\n    import e\n")  # fmt: skip
    kinds = {node.names[0].name: kind for kind, node in graph.import_nodes(tree)}
    assert kinds == {"a": graph.TOP, "b": graph.TYPING, "c": graph.TOP, "d": graph.TOP, "e": graph.LAZY}
    assert graph.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_project_modules_import_each_other():
    """Over every import, lazy and TYPE_CHECKING ones too: `python tests/import_graph.py cycles --lazy` lists them."""
    found = graph.cycles((graph.TOP, graph.TYPING, graph.LAZY))
    assert not found, [" <-> ".join(c) for c in found]


# --------------------------------------------------------------------------------------- a trainer imports training
# What a trainer runs without: the buffer (Delta Lake), the flows (Prefect), the servers (FastAPI), the object store.
NOT_FOR_TRAINING = {"deltalake", "prefect", "fastapi", "s3fs"}
# The trainer, and what starts a rank: torchrun's launcher (torchrun.py) runs worker.py in each rank; a Ray rank is
# an actor of ray_group.py. Each builds its PolicyTrainer through worker.py's `_build`.
TRAINER_ENTRIES = [f"sluiceway.tasks.train.{m}" for m in ("trainer", "worker", "torchrun", "ray_group")]
EVERY_CALL = (graph.TOP, graph.LAZY)  # what a module imports at the top or when one of its functions runs


@pytest.mark.parametrize("entry", TRAINER_ENTRIES)
def test_a_trainer_reaches_no_buffer_store_or_flow_in_its_source(entry):
    """Every module `entry` may import, at the top or when one of its functions runs."""
    reached = graph.closure(entry, kinds=EVERY_CALL)
    if not entry.endswith(".torchrun"):  # the launcher: its ranks run worker.py
        assert "sluiceway.tasks.train.trainer" in reached and "sluiceway.tasks.train.samples" in reached
    bad = [f"{' -> '.join(graph.chain(entry, m, EVERY_CALL))} imports {lib}" for m in sorted(reached)
           for lib in sorted(graph.third_party_imports([m], EVERY_CALL) & NOT_FOR_TRAINING)]  # fmt: skip
    assert not bad, bad


def test_the_sample_types_import_nothing_of_storage():
    assert not {m for m in graph.imports_of("sluiceway.tasks.train.samples") if m.startswith("sluiceway.storage")}


def test_a_trainer_rank_loads_no_buffer_store_or_flow():
    """A fresh interpreter imports what a rank does: the entry points, then what worker.py's `_build` imports."""
    builds = [m for m, kind in graph.imports_of("sluiceway.tasks.train.worker").items() if kind == graph.LAZY]
    assert "sluiceway.tasks.train.trainer" in builds
    code = "import importlib, json, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    code += "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code, *TRAINER_ENTRIES, *builds], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "sluiceway.tasks.train.trainer" in loaded
    assert not sorted(m for m in loaded if m.split(".")[0] in NOT_FOR_TRAINING)
