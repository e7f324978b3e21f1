"""The house rules on how src/wrenmq is put together, checked on every `make test`.

- Imports go only downward between layers (LAYERS, lowest first), at the top of a module
  or inside a function alike: a part never imports one above it. Within a layer the
  parts may import each other.
- No module is over MAX_LINES lines (bench/ aside).
- No module uses another module's underscored names (`other._name`, `from x import
  _name`): what one part needs of another is a public interface.

The lists at the end name what is still to fix. Each entry must still be needed: once
it is fixed the test says so, and the entry goes.
"""

import ast
import collections
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "wrenmq"

# Parts of src/wrenmq: a package, or a module at the top (without .py). `wrenmq` is the
# package's own __init__.py, which gives `wrenmq.Broker` (the assembled broker).
LAYERS = (
    ("mqtt", "_compiled"),  # the wire format: codec, packets, topic names and filters
    ("store", "net", "config", "config_docs", "config_import", "mosquitto_config", "logfiles", "ports"),
    ("broker",),
    ("auth", "cluster", "pipeline", "bridge", "admin", "webhooks"),
    ("assemble", "cli", "bench", "__main__", "wrenmq"),  # the assembly and the commands
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
# What any module may import from the package's __init__.py (bound before anything else).
FROM_ROOT_ANYWHERE = {"__version__"}

MAX_LINES = 900
LONG_ASIDE = ("bench",)


def _modules(src):
    """{module name: path} of every module under `src` (a `wrenmq` package directory)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _part(module):
    """The part of src/wrenmq a module belongs to (LAYERS)."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "wrenmq"


def _package(module, path):
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module, path, tree, modules):
    """(line, imported module, names) for every import of a wrenmq module in `tree`; a
    `from package import name` whose name is a module counts as an import of that module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "wrenmq":
                    yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(module, path).split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "wrenmq":
                continue
            plain = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    yield node.lineno, sub, ()
                else:
                    plain.append(alias.name)
            if plain:
                yield node.lineno, target, tuple(plain)


def _defined(tree):
    """Every name a module defines or assigns (functions, classes, attributes it sets,
    arguments, __slots__): an underscored name among them is the module's own."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                  for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def _private(name):
    return name.startswith("_") and not name.startswith("__")


class House:
    """What a scan of one `wrenmq` package directory finds."""

    def __init__(self, src):
        self.src = src
        self.modules = _modules(src)
        self.upward = []  # "path:line: ..." of each import of a layer above
        self.unknown = set()  # parts not in LAYERS
        self.private = collections.defaultdict(list)  # (path, underscored name) -> lines
        self.lines = {}  # path -> lines, for the modules the line limit applies to
        for module, path in self.modules.items():
            self._scan(module, path)

    def _scan(self, module, path):
        rel = path.relative_to(self.src).as_posix()
        text = path.read_text()
        if rel.split("/")[0] not in LONG_ASIDE:
            self.lines[rel] = len(text.splitlines())
        tree = ast.parse(text, str(path))
        part = _part(module)
        if part not in LAYER:
            self.unknown.add(part)
            return
        for line, target, names in _imports(module, path, tree, self.modules):
            if target == "wrenmq" and set(names) <= FROM_ROOT_ANYWHERE:
                continue
            to = _part(target)
            if to not in LAYER:
                self.unknown.add(to)
            elif LAYER[to] > LAYER[part]:
                self.upward.append(f"{rel}:{line}: {part} (layer {LAYER[part]}) imports {target} "
                                   f"({to}, layer {LAYER[to]})")
            last = target.rpartition(".")[2]
            if _private(last) and _package(module, path) != target.rpartition(".")[0]:
                self.private[(rel, last)].append(line)  # another package's private module
            for name in names:
                if _private(name):
                    self.private[(rel, name)].append(line)
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                self.private[(rel, node.attr)].append(node.lineno)

    def too_long(self, still_to_split):
        """What breaks the line limit, and entries of `still_to_split` no longer needed."""
        out = []
        for rel, n in sorted(self.lines.items()):
            if n > MAX_LINES and rel not in still_to_split:
                out.append(f"{rel}: {n} lines (at most {MAX_LINES})")
            elif n <= MAX_LINES and rel in still_to_split:
                out.append(f"{rel}: {n} lines now: take it off test_layers.STILL_TO_SPLIT")
        out += [f"{rel}: no such module: take it off test_layers.STILL_TO_SPLIT"
                for rel in sorted(still_to_split) if rel not in self.lines]
        return out

    def private_uses(self, still_private):
        """Uses of another module's underscored names, and entries of `still_private` no
        longer needed."""
        out = [f"{rel}:{lines[0]}: {name}, which {rel} does not define"
               for (rel, name), lines in sorted(self.private.items()) if (rel, name) not in still_private]
        out += [f"{rel}: {name} is no longer used there: take it off test_layers.STILL_PRIVATE"
                for rel, name in sorted(still_private) if (rel, name) not in self.private]
        return out


HOUSE = House(SRC)


def test_every_part_has_a_layer():
    assert not HOUSE.unknown, f"parts of src/wrenmq not in test_layers.LAYERS: {sorted(HOUSE.unknown)}"


def test_imports_only_go_down():
    assert not HOUSE.upward, "imports of a layer above:\n" + "\n".join(HOUSE.upward)


def test_no_module_over_the_line_limit():
    problems = HOUSE.too_long(STILL_TO_SPLIT)
    assert not problems, "\n".join(problems)


def test_no_use_of_another_modules_underscored_names():
    problems = HOUSE.private_uses(STILL_PRIVATE)
    assert not problems, "\n".join(problems)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """A made-up package with one of each fault: the scan names the module and line."""
    pkg = tmp_path / "wrenmq"
    files = {
        "__init__.py": "__version__ = '0'\n",
        "store/__init__.py": "",
        "store/_epoch.py": "",
        "store/reader.py": ("from .. import __version__\n"
                            "def read(router):\n"
                            "    from ..broker.topics import TopicTrie\n"
                            "    return router._match(TopicTrie)\n"),
        "broker/__init__.py": "",
        "broker/topics.py": "class TopicTrie:\n    def _match(self):\n        return self._match\n",
        "broker/long.py": "x = 1\n" * (MAX_LINES + 1),
        "cluster/__init__.py": "from ..store import _epoch\nfrom ..broker.topics import TopicTrie\n",
        "gadgets/__init__.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    house = House(pkg)
    assert house.upward == ["store/reader.py:3: store (layer 1) imports wrenmq.broker.topics (broker, layer 2)"]
    assert house.unknown == {"gadgets"}
    assert house.too_long(set()) == [f"broker/long.py: {MAX_LINES + 1} lines (at most {MAX_LINES})"]
    assert house.too_long({"broker/long.py", "broker/topics.py"}) == [
        "broker/topics.py: 3 lines now: take it off test_layers.STILL_TO_SPLIT"]
    assert house.private_uses(set()) == [
        "cluster/__init__.py:1: _epoch, which cluster/__init__.py does not define",
        "store/reader.py:4: _match, which store/reader.py does not define"]
    assert house.private_uses({("store/reader.py", "_match"), ("cluster/__init__.py", "_epoch"),
                               ("store/reader.py", "_gone")}) == [
        "store/reader.py: _gone is no longer used there: take it off test_layers.STILL_PRIVATE"]


# --- exceptions ---------------------------------------------------------------

# Modules allowed over MAX_LINES (path under src/wrenmq): none. The sets stay so that
# an exception, if one is ever needed, is written here with its reason, and the test
# says when it is no longer needed.
STILL_TO_SPLIT = set()

# (module under src/wrenmq, underscored name it uses of another module): none.
STILL_PRIVATE = set()
