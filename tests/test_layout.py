"""The code's layout: no import cycles in src/, and every backend satisfies the `Backend` protocol;
only cli/ imports training/; no module base name twice; the source narrates no history, and its
pointers into the docs resolve.

The checks read the source (ast, text), so they hold for the llama.cpp backend without its extra.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import specdec
from specdec.backends import Backend

SRC = Path(specdec.__file__).parent


def module_name(path: Path, root: Path = SRC) -> str:
    parts = ["specdec", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """module -> the specdec modules it imports anywhere in its body (function-level imports too:
    a cycle hidden in a function is still a cycle). `from . import x` names the submodule x;
    the parent packages Python initialises on the way are not counted as edges."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                           for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_src_has_no_import_cycle():
    graph = import_graph()
    assert "specdec.backends.transformers" in graph and "specdec.models.loading" in graph
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_function_level_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "c.py").write_text("from .a import x\n")
    (tmp_path / "d.py").write_text("from .a import x\n")
    assert cycles(import_graph(tmp_path)) == [["specdec.a", "specdec.b", "specdec.c"]]


def protocol_members(protocol: type) -> tuple[set[str], dict[str, inspect.Signature]]:
    """The protocol's data attributes and its methods with their signatures."""
    attributes = set(getattr(protocol, "__annotations__", {}))
    methods = {name: inspect.signature(value) for name, value in vars(protocol).items()
               if callable(value) and not name.startswith("_")}
    return attributes, methods


def class_members(cls: type) -> tuple[set[str], dict[str, inspect.Signature]]:
    """What instances of `cls` have: class attributes, properties and every `self.x = ...` in its
    methods (read from the source, so no instance is needed), and its public methods."""
    attributes = {name for name, value in vars(cls).items() if not callable(value) or isinstance(value, property)}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) and \
                        element.value.id == "self":
                    attributes.add(element.attr)
    methods = {name: inspect.signature(getattr(cls, name)) for name, value in vars(cls).items()
               if callable(value) and not isinstance(value, type) and not name.startswith("_")}
    return attributes, methods


def protocol_gaps(cls: type, protocol: type = Backend) -> list[str]:
    """What `cls` lacks of `protocol`: missing attributes or methods, and methods whose parameters
    (names, in order, and defaults) differ from the protocol's."""
    want_attributes, want_methods = protocol_members(protocol)
    have_attributes, have_methods = class_members(cls)
    gaps = [f"attribute {name}" for name in sorted(want_attributes - have_attributes - set(have_methods))]
    for name, signature in want_methods.items():
        if name not in have_methods:
            gaps.append(f"method {name}")
            continue
        want = [(p.name, p.default) for p in signature.parameters.values()]
        have = [(p.name, p.default) for p in have_methods[name].parameters.values()][:len(want)]
        if have != want:
            gaps.append(f"method {name}{have_methods[name]} differs from {signature}")
    return gaps


def test_every_backend_satisfies_the_protocol():
    from specdec.backends.captured import CapturedModel
    from specdec.backends.llamacpp import LlamaCppModel  # importable without llama-cpp-python
    from specdec.backends.transformers import TransformersModel

    assert protocol_gaps(TransformersModel) == []
    assert protocol_gaps(LlamaCppModel) == []
    assert protocol_gaps(CapturedModel) == []


def test_the_protocol_check_sees_a_missing_member_and_a_changed_signature():
    from specdec.backends.transformers import TransformersModel

    class Partial(TransformersModel):
        def forward(self, input_ids, cache=None, num_logits: int = 2, parents=None, tree_start=None):
            return None

    Wider = type("Wider", (), {"__annotations__": {"name": str, "colour": str}})
    assert any(gap.startswith("method forward") for gap in protocol_gaps(Partial))
    assert protocol_gaps(TransformersModel, Wider) == ["attribute colour"]


def test_a_loaded_transformers_model_has_every_protocol_member():
    from conftest import tiny_model

    model = tiny_model(0)
    attributes, methods = protocol_members(Backend)
    assert [name for name in sorted(attributes | set(methods)) if not hasattr(model, name)] == []


@pytest.mark.parametrize("module", ["specdec.models.loading", "specdec.backends.transformers", "specdec.backends.text"])
def test_loading_is_apart_from_the_backends(module):
    """models/loading.py loads and picks; the backends never import it."""
    graph = import_graph()
    if module == "specdec.models.loading":
        assert "specdec.backends.transformers" in graph[module]
    else:
        assert "specdec.models.loading" not in graph[module]


@pytest.mark.slow
def test_a_built_wheel_carries_the_package_its_data_and_both_commands(tmp_path):
    """`pip install .` and a built wheel work alone: the distribution (lossless-specdec; "specdec"
    on the package index is another project) holds every module, the Spec-Bench data the bench
    reads, and the `specdec` and `lossless-specdec` commands."""
    import importlib.util
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parents[1]
    # with setuptools here, built as it is; else pip fetches the build backend (the package index)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "-q", "-w", str(tmp_path),
                            *isolation], capture_output=True, text=True)
    if built.returncode != 0 and isolation == [] and "setuptools" in built.stderr:
        pytest.skip("no setuptools here and the package index is out of reach: the wheel cannot be built")
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("lossless_specdec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    sources = {f"specdec/{p.relative_to(SRC).as_posix()}" for p in SRC.rglob("*.py")}
    assert sources <= names
    assert {"specdec/bench/data/spec_bench_dev.jsonl", "specdec/bench/data/LICENSE-Spec-Bench"} <= names
    assert "specdec = specdec.cli:main" in entry_points and "lossless-specdec = specdec.cli:main" in entry_points
    installed = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(installed), str(wheel)],
                   check=True, capture_output=True)
    found = subprocess.run([sys.executable, "-c", "import specdec; from specdec.bench.datasets import load_prompts; "
                            "print(specdec.__file__); print(len(load_prompts('spec-bench', 1)))"],
                           capture_output=True, text=True, env={"PYTHONPATH": str(installed)}, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    where, count = found.stdout.split()
    assert Path(where).is_relative_to(installed) and int(count) == 6


def importers_of(graph: dict[str, set[str]], package: str, allowed: tuple[str, ...]) -> list[str]:
    """The modules outside `package` and the `allowed` packages that import from `package`, sorted."""
    def inside(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return sorted(name for name, edges in graph.items()
                  if not any(inside(name, p) for p in (package, *allowed)) and any(inside(e, package) for e in edges))


def test_only_the_training_commands_import_training():
    """training/ holds the fit loops; what runs a trained module (adapters/) never imports them."""
    graph = import_graph()
    assert any(e.startswith("specdec.training.") for e in graph["specdec.cli.training"])
    assert importers_of(graph, "specdec.training", ("specdec.cli",)) == []


def test_the_training_import_check_finds_a_run_time_importer(tmp_path):
    for folder in ("training", "cli", "adapters"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "training" / "fit.py").write_text("from ..adapters.heads import Heads\n")
    (tmp_path / "cli" / "train.py").write_text("from ..training.fit import train\n")
    (tmp_path / "adapters" / "heads.py").write_text("def load():\n    from ..training import fit\n")
    graph = import_graph(tmp_path)
    assert importers_of(graph, "specdec.training", ("specdec.cli",)) == ["specdec.adapters.heads"]


def duplicate_base_names(root: Path = SRC) -> dict[str, list[str]]:
    """{base name: its modules} for every module base name (`__init__` aside) found more than once."""
    places: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.stem != "__init__":
            places.setdefault(path.stem, []).append(path.relative_to(root).as_posix())
    return {name: where for name, where in places.items() if len(where) > 1}


def test_no_two_modules_share_a_base_name_and_the_top_level_is_small():
    assert duplicate_base_names() == {}
    top_level = sorted(p.name for p in SRC.glob("*.py"))
    assert "errors.py" in top_level and len(top_level) <= 6, top_level


def test_the_base_name_check_finds_a_doubled_name(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "parallel.py").write_text("")
    (tmp_path / "a" / "only.py").write_text("")
    assert duplicate_base_names(tmp_path) == {"parallel": ["a/parallel.py", "b/parallel.py"]}


HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bissue \d+")
DOCS_CITED = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def narrated_history(root: Path = SRC) -> list[str]:
    """`path:line` of every date or "issue N" in the source: measurements and their history belong
    in the docs, which the code points to (docs/PAGE.md#heading)."""
    return [f"{path.relative_to(root).as_posix()}:{number}" for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]


def test_the_source_narrates_no_history_and_its_docs_pointers_resolve():
    from test_docs import anchors

    assert narrated_history() == []
    docs = Path(__file__).resolve().parents[1] / "docs"
    cited = {match.groups() for path in SRC.rglob("*.py") for match in DOCS_CITED.finditer(path.read_text())}
    assert ("kernels.md", "packed-bf16-linears") in cited
    broken = sorted(f"{page}#{anchor}" if anchor else page for page, anchor in cited
                    if not (docs / page).is_file() or (anchor and anchor not in anchors(docs / page)))
    assert broken == []


def test_the_history_check_finds_a_date_and_an_issue(tmp_path):
    (tmp_path / "a.py").write_text('"""Fast."""\n# was 191 ms on 2026-11-29\n')
    (tmp_path / "b.py").write_text("x = 1  # issue 47 measured it\ny = 2  # tissue 5 is no issue\n")
    assert narrated_history(tmp_path) == ["a.py:2", "b.py:1"]


CROSS_CUTTING = {"test_contracts.py", "test_docs.py", "test_layout.py"}  # about the whole tree, not one package


def mirror_breaks(tests: Path = Path(__file__).resolve().parent, src: Path = SRC) -> list[str]:
    """What breaks the tests' mirror of src/specdec: a test folder that is no package, or a test
    file at the top that is not about the whole tree."""
    packages = {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    wrong = [f"{p.name}/" for p in sorted(tests.iterdir())
             if p.is_dir() and any(p.glob("test_*.py")) and p.name not in packages]
    return wrong + [p.name for p in sorted(tests.glob("test_*.py")) if p.name not in CROSS_CUTTING]


def test_the_tests_mirror_the_packages(tmp_path):
    assert mirror_breaks() == []
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "test_a.py").write_text("")
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "test_b.py").write_text("")
    (tmp_path / "test_c.py").write_text("")
    assert mirror_breaks(tmp_path) == ["stray/", "test_c.py"]  # the check sees both kinds
