"""The package's modules import one another without a cycle, counting imports inside functions
(a cycle hidden in a function still ties two modules into one unit to read and change); imports
under ``if TYPE_CHECKING:`` are annotations, not imports, and do not count.  The engine's folders form
layers (``LAYERS``: a folder imports only from lower ones), only ``manager``, ``options``, ``errors``
and ``names`` sit at engine/'s top, and ``names`` imports nothing of ours."""

import ast
import pathlib

import datastates_megatron

ROOT = pathlib.Path(datastates_megatron.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs if subs else ({target} & modules.keys()))
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_the_package_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_names_module_imports_nothing_of_ours():
    """Every name the package writes is made in ``engine.names``; anything may import it, so it
    imports no module of the package (and only the stdlib)."""
    modules = _modules()
    name = "datastates_megatron.engine.names"
    assert _imports(name, modules[name], modules) == set()
    tree = ast.parse(modules[name].read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "os", "re"}, imported


# ------------------------------------------------------------------ the engine's layers
ENGINE = "datastates_megatron.engine"
# Lowest first.  A module imports only from its own folder and from folders of lower layers; two
# folders of one layer never import each other.  A new folder (or a module at engine/'s top) must be
# placed here.  Why this order: docs/architecture.md, "engine/ by concern".
LAYERS = (
    ("errors", "names"),  # the error classes; every name written on disk (stdlib only)
    ("options",),  # validated options (errors)
    ("runtime",),  # owned threads, crash points
    ("fs",),  # safe opens, durable writes, page cache, mappings, the directory lock
    ("format",),  # checksums, the rank file, its writer, the manifest, the global index
    ("dist",),  # cross-rank agreement, the commit's store channel
    ("save", "tiers"),  # the snapshot engine | a tier and what it owns (commit, retention, promotion, replication)
    ("load",),  # the load plan, the verifying reader, the restart's resolve step
    ("manager",),  # CheckpointManager: everything above, put together
    ("__init__",),  # the engine's public names
)
TOP_MODULES = {"manager", "options", "errors", "names"}  # the only modules at engine/'s top


def _unit(module: str) -> str | None:
    """The folder (or top-level module) of engine/ that ``module`` belongs to; None outside the engine."""
    if module == ENGINE:
        return "__init__"
    if not module.startswith(ENGINE + "."):
        return None
    return module[len(ENGINE) + 1 :].split(".")[0]


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between the engine's folders that go up or sideways, and folders not in LAYERS."""
    level = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    out = []
    for module in sorted(graph):
        mine = _unit(module)
        if mine is None:
            continue
        if mine not in level:
            out.append(f"{module}: engine/{mine} is in no layer of LAYERS")
            continue
        for target in sorted(graph[module]):
            theirs = _unit(target)
            if theirs is None or theirs == mine:
                continue
            if theirs not in level:
                out.append(f"{module} imports {target}: engine/{theirs} is in no layer of LAYERS")
            elif level[theirs] >= level[mine]:
                out.append(f"{module} ({mine}, layer {level[mine]}) imports {target} ({theirs}, layer {level[theirs]})")
    return out


def _top_module_violations(graph: dict[str, set[str]], is_package) -> list[str]:
    """Modules at engine/'s top other than TOP_MODULES that another folder's modules import."""
    out = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            unit = _unit(target)
            if unit is None or unit == "__init__" or is_package(target) or unit in TOP_MODULES:
                continue
            if target == f"{ENGINE}.{unit}" and _unit(module) != unit:
                out.append(f"{module} imports {target}, a module at engine/'s top")
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, pathlib.Path]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}, modules


def test_the_layer_checker_finds_an_import_that_goes_up_or_sideways():
    fine = {
        f"{ENGINE}.format.manifest": {f"{ENGINE}.fs.safe_io", f"{ENGINE}.names", f"{ENGINE}.format.hashing"},
        f"{ENGINE}.manager": {f"{ENGINE}.tiers.tier", f"{ENGINE}.load.reader"},
        "datastates_megatron.cli": {f"{ENGINE}.tiers.tier"},
    }
    assert _layer_violations(fine) == []
    up = {**fine, f"{ENGINE}.fs.safe_io": {f"{ENGINE}.format.manifest"}}
    assert _layer_violations(up) == [
        f"{ENGINE}.fs.safe_io (fs, layer 3) imports {ENGINE}.format.manifest (format, layer 4)"
    ]
    sideways = {f"{ENGINE}.save.snapshot": {f"{ENGINE}.tiers.tier"}}
    assert len(_layer_violations(sideways)) == 1
    into_the_manager = {f"{ENGINE}.tiers.commit": {f"{ENGINE}.manager"}}
    assert len(_layer_violations(into_the_manager)) == 1
    new_folder = {f"{ENGINE}.cloud.s3": {f"{ENGINE}.errors"}}
    assert _layer_violations(new_folder) == [f"{ENGINE}.cloud.s3: engine/cloud is in no layer of LAYERS"]


def test_the_top_module_checker_finds_a_helper_at_engines_top():
    def is_package(name):
        return name in {f"{ENGINE}.fs", f"{ENGINE}.tiers"}

    helper = {f"{ENGINE}.tiers.tier": {f"{ENGINE}.helpers", f"{ENGINE}.names", f"{ENGINE}.fs"}}
    assert _top_module_violations(helper, is_package) == [
        f"{ENGINE}.tiers.tier imports {ENGINE}.helpers, a module at engine/'s top"
    ]
    assert _top_module_violations({f"{ENGINE}.tiers.tier": {f"{ENGINE}.errors", f"{ENGINE}.manager"}}, is_package) == []


def test_the_engines_folders_are_layered():
    graph, _ = _graph()
    assert _layer_violations(graph) == []


def test_no_module_at_engines_top_but_the_four_is_imported_by_another_folder():
    graph, modules = _graph()
    assert _top_module_violations(graph, lambda name: modules[name].name == "__init__.py") == []
    top = {name.rpartition(".")[2] for name, path in modules.items() if path.parent.name == "engine"} - {"engine"}
    assert top == TOP_MODULES, top
