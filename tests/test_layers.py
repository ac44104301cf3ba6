"""The package layers of ARCHITECTURE.md, enforced: each package imports only the packages
below it, no module imports itself back through others (no cycles), and the planning
arithmetic runs without torch.distributed.

Every import counts: at module level, inside functions and under TYPE_CHECKING alike, since
a type-only import is still an arrow a reader has to follow.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import pkgutil

import overlap
import overlap.kernels

# Package -> the packages it may import (besides itself). "api" is the public face:
# overlap/__init__.py, overlap/sharded_module.py, overlap/fsdp.py, overlap/pipeline_stage.py and
# overlap/schedule_prefetch.py.
ALLOWED: dict[str, set[str]] = {
    "kernels": {"_C"},                  # the compiled extension the ext backend loads
    "models": {"base"},                 # the expert capacity rule the runtime applies too
    "base": {"kernels"},
    "optim": {"kernels"},
    "plan": {"base"},
    "runtime": {"base", "kernels", "optim"},
    "observe": {"base", "plan", "runtime"},
    "control": {"base", "plan", "runtime", "observe", "kernels", "optim"},
    "api": {"base", "plan", "runtime", "observe", "control", "kernels", "optim"},
    "checkpoint": {"base", "runtime", "api", "optim"},
    "train": {"base", "observe", "api", "checkpoint", "models", "optim"},
    "integrations": {"base", "api", "checkpoint"},
    "cli": {"base", "plan", "runtime", "observe", "control", "api", "checkpoint", "train", "models", "kernels",
            "optim"},
    "__main__": {"cli"},
}
API_MODULES = {"overlap", "overlap.sharded_module", "overlap.fsdp", "overlap.pipeline_stage", "overlap.schedule_prefetch"}


def _modules() -> list[str]:
    names = ["overlap"]
    names += [m.name for m in pkgutil.walk_packages(overlap.__path__, "overlap.")]
    # overlap.kernels is a namespace package (kernels/ has no __init__.py), which the walk
    # above does not enter.
    names += [m.name for m in pkgutil.walk_packages(overlap.kernels.__path__, "overlap.kernels.")]
    # Python source only: overlap._C is the compiled extension.
    return sorted(n for n in names if importlib.util.find_spec(n).origin.endswith(".py"))


def _package(module: str) -> str:
    if module in API_MODULES:
        return "api"
    parts = module.split(".")
    assert parts[0] == "overlap" and len(parts) > 1, module
    return parts[1]


def _imports(module: str) -> set[str]:
    """Every overlap module `module` imports, resolved to modules (not names in them)."""
    # find_spec, not a path under the checkout: overlap.kernels is installed from kernels/.
    spec = importlib.util.find_spec(module)
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    is_package = spec.submodule_search_locations is not None
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if not base.startswith("overlap"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("overlap"))
    found.discard(module)
    return found


MODULES = set(_modules())
GRAPH = {module: _imports(module) for module in MODULES}


def test_every_package_is_in_the_table():
    assert {_package(m) for m in GRAPH} <= set(ALLOWED), sorted({_package(m) for m in GRAPH} - set(ALLOWED))


def test_no_upward_arrows():
    wrong = []
    for module, imported in GRAPH.items():
        own = _package(module)
        for target in imported:
            other = _package(target)
            if other != own and other not in ALLOWED[own]:
                wrong.append(f"{module} ({own}) imports {target} ({other})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            # A package's __init__ that re-exports its modules is not an arrow back up.
            if module.startswith(target + "."):
                continue
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target in GRAPH and state.get(target) is None:
                visit(target, path + [target])
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_planning_arithmetic_needs_no_process_group():
    """plan/ is arithmetic: it must run, and be tested, without torch.distributed."""
    for module in GRAPH:
        if _package(module) != "plan":
            continue
        tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith("torch.distributed") for n in names), (module, names)
