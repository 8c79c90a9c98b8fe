"""The layering of parallax/: each module imports only its own layer or lower ones, as docs/design.md's
"Layers and file map" lists them; the map names every module, and only modules that exist; JAX's
non-public API is imported by parallax/compat.py alone."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "parallax"
DESIGN = ROOT / "docs" / "design.md"

_LAYER = re.compile(r"^### Layer (\d+): \S")
_ENTRY = re.compile(r"^- `(parallax/[\w/]+\.py)`: \S")


def design_layers() -> dict[str, int]:
    """{module file (relative to the checkout): layer} from docs/design.md's "## Layers and file map"."""
    text = DESIGN.read_text()
    assert text.count("\n## Layers and file map\n") == 1, "docs/design.md needs one '## Layers and file map' section"
    section = text.split("\n## Layers and file map\n", 1)[1].split("\n## ", 1)[0]
    layers, layer = {}, None
    for line in section.splitlines():
        if line.startswith("### "):
            m = _LAYER.match(line)
            assert m, f"docs/design.md: {line!r} is not '### Layer N: name'"
            assert int(m.group(1)) == (-1 if layer is None else layer) + 1, f"layers out of order at {line!r}"
            layer = int(m.group(1))
        elif line.startswith("- "):
            m = _ENTRY.match(line)
            assert m, f"docs/design.md: {line!r} is not '- `parallax/....py`: what it owns'"
            assert layer is not None, f"docs/design.md: {line!r} comes before the first layer"
            assert m.group(1) not in layers, f"docs/design.md lists {m.group(1)} twice"
            layers[m.group(1)] = layer
    assert layers, "docs/design.md's file map lists no module"
    return layers


def library_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in LIBRARY.rglob("*.py"))


def _dotted(file: str) -> str:
    parts = file[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: str, modules: dict[str, str], root: pathlib.Path = ROOT) -> set[str]:
    """The parallax modules (files) that `file` imports, at the top or inside functions, in every form:
    `import parallax.a.b`, `from parallax.a import b` (b a module or a name in a), relative imports.
    `modules`: {dotted name: file}, files relative to `root`. An import of a parallax module that is not
    there fails."""
    here = _dotted(file)
    package = here if file.endswith("__init__.py") else here.rpartition(".")[0]
    found = set()

    def add(name, optional_child=None):
        if optional_child and f"{name}.{optional_child}" in modules:
            found.add(modules[f"{name}.{optional_child}"])
        else:
            assert name in modules, f"{file} imports {name}, which is no module of parallax/"
            found.add(modules[name])

    for node in ast.walk(ast.parse((root / file).read_text(), file)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "parallax" or alias.name.startswith("parallax."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "parallax" or module.startswith("parallax."):
                for alias in node.names:
                    add(module, alias.name)
    found.discard(file)
    return found


def test_the_file_map_names_every_module_of_parallax_and_only_those():
    mapped, present = set(design_layers()), set(library_files())
    missing, stale = sorted(present - mapped), sorted(mapped - present)
    assert not missing and not stale, (f"docs/design.md's file map: modules missing (add a line for each): {missing}; "
                                       f"modules that do not exist: {stale}")


def test_every_module_imports_only_its_own_layer_or_lower():
    layers = design_layers()
    files = library_files()
    modules = {_dotted(f): f for f in set(files) | set(layers)}
    # A module missing from the map has no layer: the test above names it; its imports are not judged here.
    upward = [f"{f} (layer {layers[f]}) imports {dep} (layer {layers[dep]})"
              for f in files if f in layers
              for dep in sorted(imported_modules(f, modules)) if dep in layers and layers[dep] > layers[f]]
    assert not upward, "upward imports (docs/design.md, 'Layers and file map'):\n" + "\n".join(upward)


def test_only_compat_touches_jax_internals():
    """`jax._src` anywhere (an import, importlib, a string), or an import from jax.extend / jax.interpreters
    (API that changes without jax's deprecation cycle), outside parallax/compat.py."""
    offenders = []
    for file in library_files():
        if file == "parallax/compat.py":
            continue
        text = (ROOT / file).read_text()
        if "jax._src" in text:
            offenders.append(f"{file}: jax._src")
        for node in ast.walk(ast.parse(text, file)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{file}:{node.lineno}: {n}" for n in names
                          if n.startswith(("jax.extend", "jax.interpreters"))]
    assert not offenders, "import these through parallax/compat.py:\n" + "\n".join(offenders)


def test_the_import_walk_sees_every_form_of_import(tmp_path):
    """The walker above on a module that imports in each form, top-level and inside a function."""
    lib = tmp_path / "parallax" / "pipeline"
    lib.mkdir(parents=True)
    (tmp_path / "parallax" / "__init__.py").write_text("")
    (lib / "__init__.py").write_text("")
    for name in ("schedule", "program"):
        (lib / f"{name}.py").write_text("")
    for name in ("mesh", "plan", "train", "data"):
        (tmp_path / "parallax" / f"{name}.py").write_text("")
    (lib / "executor.py").write_text(
        "import parallax.mesh\n"
        "from parallax import plan\n"
        "from . import schedule\n"
        "from .program import Program\n"
        "def f():\n"
        "    from parallax.train import train_and_evaluate\n"
        "    from .. import data\n")
    files = [str(p.relative_to(tmp_path)) for p in (tmp_path / "parallax").rglob("*.py")]
    modules = {_dotted(f): f for f in files}
    assert imported_modules("parallax/pipeline/executor.py", modules, tmp_path) == {
        "parallax/mesh.py", "parallax/plan.py", "parallax/pipeline/schedule.py", "parallax/pipeline/program.py",
        "parallax/train.py", "parallax/data.py"}


def test_importing_the_mutation_tests_starts_no_jax_runtime():
    """`make mutation` forks one process per mutant from a server that collected the selected tests; a test
    file that starts JAX's runtime at import (`jax.devices()` at module level) leaves its threads in that
    server, and the forked mutants deadlock (seen: every worker asleep after the first mutant)."""
    import subprocess
    import sys
    import tomllib

    selection = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    files = sorted({t.split("::")[0] for t in selection["pytest_add_cli_args_test_selection"]})
    modules = [pathlib.Path(f).stem for f in files]
    assert modules, "pyproject.toml's [tool.mutmut] selects no test file"
    code = ("import sys, importlib; sys.path[:0] = ['tests', '.']; import conftest\n"
            "from jax._src import xla_bridge\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert not xla_bridge._backends, f'importing tests/{name}.py starts JAX (a device query at module level?)'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr.strip().splitlines()[-1]
