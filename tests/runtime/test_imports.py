"""The runtime is its own package: it imports the standard library, numpy, tokenizers, its engines and
pipeline.errors (and jinja2 for chat templates, in chat.py only), nothing of the build; no module of the
pipeline imports itself back through another; each layer imports only the layers it may; and
pipeline/build/stages/ holds exactly the stage table's modules, none of which imports another."""

import ast
import sys
from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
ALLOWED = {"numpy", "tokenizers", "onnxruntime", "openvino", "tensorrt", "cuda"}
# Packages allowed in one runtime module only: jinja2 renders chat templates, lazily, in chat.py.
ALLOWED_IN = {"jinja2": {"runtime/chat.py"}, "PIL": {"runtime/images.py"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PIPELINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    found = set()
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from pipeline.build.stages import engine` imports pipeline.build.stages.engine (a package too)
            folder = PIPELINE.parent / base.replace(".", "/")
            found |= {
                f"{base}.{alias.name}"
                for alias in node.names
                if (folder / f"{alias.name}.py").exists() or (folder / alias.name / "__init__.py").exists()
            }
    return found


def test_runtime_imports_nothing_of_the_build():
    offenders = []
    for path in sorted((PIPELINE / "runtime").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("pipeline."):
                if not (name == "pipeline.errors" or name.startswith("pipeline.runtime")):
                    offenders.append(f"{path.relative_to(PIPELINE)}: {name}")
            elif top in ALLOWED_IN:
                if str(path.relative_to(PIPELINE)) not in ALLOWED_IN[top]:
                    offenders.append(f"{path.relative_to(PIPELINE)}: {name}")
            elif top not in ALLOWED and top not in sys.stdlib_module_names and top != "__future__":
                offenders.append(f"{path.relative_to(PIPELINE)}: {name}")
    assert not offenders, offenders


def test_imports_detector_sees_a_build_import(tmp_path):
    # The check above must be able to fail: a lazy import of a build module inside a function is found.
    probe = PIPELINE / "runtime" / "_probe_for_test.py"
    probe.write_text("def f():\n    from pipeline.build.stages import engine\n    import torch\n")
    try:
        assert {"pipeline.build.stages.engine", "torch"} <= _imports(probe)
    finally:
        probe.unlink()


def test_no_import_cycle_between_modules():
    modules = {_module_name(p): p for p in PIPELINE.rglob("*.py")}
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ importing its own modules is how a package exposes them, not a cycle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state, cycle = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycle, cycle


def test_no_stage_imports_the_benchmarks():
    offenders = [
        f"{path.relative_to(PIPELINE)}: {name}"
        for path in sorted((PIPELINE / "build" / "stages").rglob("*.py"))
        for name in _imports(path)
        if name == "pipeline.bench" or name.startswith("pipeline.bench.")
    ]
    assert not offenders, offenders


def test_gc_and_the_store_import_no_stage():
    # gc and the cache share the layout and locks through pipeline.build.store, never through a stage's module.
    offenders = [
        f"{name}: {module}"
        for name in ("ops/gc.py", "ops/gc_cache.py", "build/store.py", "build/cache.py")
        for module in _imports(PIPELINE / name)
        if module == "pipeline.build.stages" or module.startswith("pipeline.build.stages.")
    ]
    assert not offenders, offenders


def test_jinja2_is_imported_lazily_and_only_by_chat():
    # A module-level import would cost every loader the import; only the first chat call pays it.
    for path in sorted((PIPELINE / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top_level |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert "jinja2" not in top_level, path
        assert ("jinja2" in {m.split(".")[0] for m in _imports(path)}) == (path.name == "chat.py"), path


# The layers, and the layers each may import: errors <- runtime <- build <- ops, bench <- cli; serving imports the
# runtime only (ops and bench may start a server).
LAYERS = {
    "errors": set(),
    "runtime": {"errors", "runtime"},
    "build": {"errors", "runtime", "build"},
    "ops": {"errors", "runtime", "build", "ops", "serving"},
    "serving": {"errors", "runtime", "serving"},
    "bench": {"errors", "runtime", "build", "ops", "serving", "bench"},
    "cli": {"errors", "runtime", "build", "ops", "serving", "bench", "cli"},
}


def _layer(relative: Path) -> str | None:
    top = relative.parts[0].removesuffix(".py")
    return "cli" if top == "__main__" else top if top in LAYERS else None


def layer_offenders(root: Path = PIPELINE) -> list[str]:
    """Each import of a module of another layer that the importing module's layer may not import."""
    offenders = []
    for path in sorted(root.rglob("*.py")):
        mine = _layer(path.relative_to(root))
        for name in sorted(_imports(path)):
            parts = name.split(".")
            theirs = _layer(Path(parts[1])) if len(parts) > 1 and parts[0] == "pipeline" else None
            if mine and theirs and theirs not in LAYERS[mine]:
                offenders.append(f"{path.relative_to(root)}: {name}")
    return offenders


def test_each_layer_imports_only_the_layers_it_may():
    assert set(LAYERS) - {"errors", "cli"} <= {p.name for p in PIPELINE.iterdir() if p.is_dir()}
    assert not layer_offenders(), layer_offenders()


def test_the_layer_check_fails_when_a_rule_is_broken_on_purpose():
    probes = {
        PIPELINE / "serving" / "_probe_for_test.py": "def f():\n    from pipeline.build.table import build\n",
        PIPELINE / "build" / "_probe_for_test.py": "from pipeline.ops import gc\n",
    }
    try:
        for path, code in probes.items():
            path.write_text(code)
        assert sorted(layer_offenders()) == [
            "build/_probe_for_test.py: pipeline.ops",
            "build/_probe_for_test.py: pipeline.ops.gc",
            "serving/_probe_for_test.py: pipeline.build.table",
        ]
    finally:
        for path in probes:
            path.unlink(missing_ok=True)


STAGES_DIR = PIPELINE / "build" / "stages"


def stage_offenders(folder: Path = STAGES_DIR) -> list[str]:
    """Each import, by a module of the stages folder, of another module of that folder."""
    package = _module_name(folder / "__init__.py")
    return [
        f"{path.name}: {name}"
        for path in sorted(folder.glob("*.py"))
        for name in sorted(_imports(path))
        if name.startswith(package + ".") and name != _module_name(path)
    ]


def test_the_stages_folder_holds_exactly_the_stage_tables_modules():
    from pipeline.build.table import STAGES

    table = {stage.__module__ for _, stage in STAGES}
    folder = {_module_name(p) for p in STAGES_DIR.glob("*.py") if p.name != "__init__.py"}
    assert folder == table, f"in the folder only: {sorted(folder - table)}; in the table only: {sorted(table - folder)}"
    assert not [p.name for p in STAGES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_no_stage_imports_another_stage():
    # What two stages share lives in a peer module (pipeline/build/search/, inputs/, engine_cache.py).
    assert not stage_offenders(), stage_offenders()


def test_the_stage_check_fails_when_a_stage_imports_another_on_purpose():
    probe = STAGES_DIR / "_probe_for_test.py"
    probe.write_text(
        "from pipeline.build.stages import engine\n"
        "from pipeline.build.stages.quantize import run\n"
        "from . import export\n"
        "from .tune import run as tune\n"
        "def f():\n    import pipeline.build.stages.fp16\n"
    )
    try:
        assert stage_offenders() == [
            f"_probe_for_test.py: pipeline.build.stages.{name}"
            for name in ("engine", "export", "fp16", "quantize", "tune")
        ]
    finally:
        probe.unlink()
