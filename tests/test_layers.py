"""The import direction between the three layers (docs/architecture.md, "Layers").

- ``weightcache.core``: shared by both sides; imports only itself and the generated stubs,
  never the SDK around it nor the daemon.
- the worker SDK (``weightcache`` outside ``core``): never imports the daemon, so a worker
  installs and imports without the daemon's code paths.
- the daemon (``weightcache_service``): imports only ``weightcache.core``, the generated
  ``weightcache.v1`` stubs and the public ``weightcache`` namespace; never a private SDK
  module.

Imports are read from the source (``ast``), including those inside functions, so a lazy
import cannot hide a wrong direction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SDK = ROOT / "client" / "weightcache"
DAEMON = ROOT / "cache_service" / "weightcache_service"


def _modules(package: Path, *, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(
        path
        for path in package.rglob("*.py")
        if not any(part in skip for part in path.relative_to(package).parts)
    )


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement of ``path`` (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; the layers need absolute names"
            assert node.module is not None
            names.add(node.module)
            # `from weightcache import _loader` names a module, not an attribute.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _private_sdk(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "weightcache" and len(parts) > 1 and parts[1].startswith("_")


CORE = _modules(SDK / "core")
WORKER_SDK = _modules(SDK, skip=("v1", "core"))
DAEMON_MODULES = _modules(DAEMON)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", CORE, ids=_rel)
def test_core_imports_neither_the_sdk_nor_the_daemon(path: Path) -> None:
    # Only the core itself and the generated stubs: the SDK's top-level namespace imports
    # private SDK modules lazily, so even `import weightcache` would point upward.
    wrong = sorted(
        name
        for name in _imports(path)
        if name.split(".")[0] == "weightcache_service"
        or (
            name.split(".")[0] == "weightcache"
            and not name.startswith(("weightcache.core", "weightcache.v1"))
        )
    )
    assert wrong == []


@pytest.mark.parametrize("path", WORKER_SDK, ids=_rel)
def test_the_worker_sdk_never_imports_the_daemon(path: Path) -> None:
    wrong = sorted(n for n in _imports(path) if n.split(".")[0] == "weightcache_service")
    assert wrong == []


@pytest.mark.parametrize("path", DAEMON_MODULES, ids=_rel)
def test_the_daemon_imports_only_the_core_the_stubs_and_the_public_sdk(path: Path) -> None:
    allowed = ("weightcache.core", "weightcache.v1")
    wrong = sorted(
        name
        for name in _imports(path)
        if name.split(".")[0] == "weightcache"
        and name != "weightcache"
        and not name.startswith(allowed)
        # `from weightcache import X` of a public name is the public SDK.
        and not (name.count(".") == 1 and not _private_sdk(name) and name != "weightcache.testing")
    )
    assert wrong == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts[1:]  # below client/, cache_service/
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _circles(modules: list[Path]) -> list[tuple[str, str]]:
    """Pairs of modules of one package that reach each other by imports (lazy ones and
    those under ``TYPE_CHECKING`` count: a circle of types is still two modules that
    cannot be understood one without the other)."""
    by_name = {_module_name(path): path for path in modules}
    edges = {
        name: {dep for dep in _imports(path) if dep in by_name and dep != name}
        for name, path in by_name.items()
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for dep in edges[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        return seen

    reached = {name: reach(name) for name in edges}
    return sorted({(a, b) for a in edges for b in reached[a] if a < b and a in reached[b]})


@pytest.mark.parametrize(
    "modules", [CORE, DAEMON_MODULES], ids=["weightcache.core", "weightcache_service"]
)
def test_no_two_modules_of_a_layer_import_each_other(modules: list[Path]) -> None:
    # Issue 39: `cache` and `seeding` imported each other (now `events.CacheEvents`), as did
    # `core.plugins` and `core.recipe` (now `core.placement.Placement`).
    assert _circles(modules) == []


def test_every_layer_was_found() -> None:
    """Guard against a moved folder silently emptying the checks above."""
    assert {p.name for p in CORE} >= {"checkpoint.py", "errors.py", "fingerprint.py"}
    assert {p.name for p in WORKER_SDK} >= {"__init__.py", "_loader.py"}
    assert {p.name for p in DAEMON_MODULES} >= {"server.py", "store.py", "cli.py"}
