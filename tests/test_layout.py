"""The package's layers: each folder imports only from the ones below it."""

import ast
import glob
import os

from absl.testing import parameterized

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lowest first (accum_model/__init__.py and docs/README.md name them).
LAYERS = ("core", "keras", "engine", "model")


def _package_imports(path):
    """The `accum_model` modules a file imports, as dotted names."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "accum_model":
                yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "accum_model":
                    yield alias.name


def _layer(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _violations(layer, imports):
    """The imports of a module of `layer` that reach up or outside."""
    rank = LAYERS.index(layer)
    bad = []
    for name in imports:
        target = _layer(name)
        if target is None or LAYERS.index(target) > rank:
            bad.append(name)
    return bad


class LayoutTest(parameterized.TestCase):
    def test_every_module_is_in_a_layer(self):
        package = os.path.join(_ROOT, "accum_model")
        loose = [
            os.path.basename(p)
            for p in glob.glob(os.path.join(package, "*.py"))
            if os.path.basename(p) != "__init__.py"
        ]
        self.assertEqual(loose, [])
        folders = sorted(
            d
            for d in os.listdir(package)
            if os.path.isfile(os.path.join(package, d, "__init__.py"))
        )
        self.assertEqual(folders, sorted(LAYERS))

    @parameterized.parameters(*LAYERS)
    def test_imports_only_downwards(self, layer):
        pattern = os.path.join(_ROOT, "accum_model", layer, "*.py")
        paths = sorted(glob.glob(pattern))
        self.assertNotEmpty(paths)
        bad = {}
        for path in paths:
            found = _violations(layer, _package_imports(path))
            if found:
                bad[os.path.basename(path)] = found
        self.assertEqual(bad, {})

    @parameterized.named_parameters(
        ("same_layer", "engine", ["accum_model.engine._state.Entry"], []),
        ("below", "engine", ["accum_model.keras._adapter"], []),
        (
            "above",
            "engine",
            ["accum_model.model._model.AccumModel"],
            ["accum_model.model._model.AccumModel"],
        ),
        (
            "top_level",
            "core",
            ["accum_model.AccumModel"],
            ["accum_model.AccumModel"],
        ),
    )
    def test_the_check_itself(self, layer, imports, expected):
        self.assertEqual(_violations(layer, imports), expected)


if __name__ == "__main__":
    from absl.testing import absltest

    absltest.main()
