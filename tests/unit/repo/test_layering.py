"""Which package may import which (docs/architecture.md): checked on the source, so it stays true.

    flows/    the pipeline's shape (Prefect flows, CLI); may import everything
    tasks/    the stages' plain logic; may import storage/, models/, infra/ and, of flows/, only the config
    storage/  tables and object stores  \
    models/   model code and loading     } never import tasks/; of flows/, only the config
    infra/    processes and places       /  and never models/: models/ sits above infra/ (the embedded engine,
                                            models/engine/, runs the models; infra/ only starts it as a process)
    flows/config/ imports nothing of the project but the error type (infra/errors.py) and plugin loading
    (infra/plugins.py); infra's leaf modules (errors, proc, cache) import nothing of the project.
"""

import ast
from pathlib import Path

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
    parts = modules("flows/config")
    assert ROOT / "flows" / "config" / "__init__.py" in parts and len(parts) > 1
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in parts for m in project_imports(p)
           if not is_config(m) and m not in ("sluiceway.infra.errors", "sluiceway.infra.plugins")}  # fmt: skip
    assert not bad, sorted(bad)
    outside = {m for p in parts for m in project_imports(p) if not is_config(m)}
    assert outside == {"sluiceway.infra.errors", "sluiceway.infra.plugins"}
    assert project_imports(ROOT / "infra" / "plugins.py") == {"sluiceway.infra.errors"}


def test_infra_never_imports_models():
    bad = {f"{p.relative_to(ROOT)} imports {m}" for p in modules("infra") for m in project_imports(p)
           if m.startswith("sluiceway.models")}  # fmt: skip
    assert not bad, sorted(bad)


@pytest.mark.parametrize("leaf", ["infra/errors.py", "infra/proc.py", "infra/cache.py"])
def test_leaf_modules_import_nothing_of_the_project(leaf):
    assert project_imports(ROOT / leaf) == set()


def test_every_package_is_checked():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} >= set(PACKAGES)
