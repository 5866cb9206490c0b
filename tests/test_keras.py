"""The version gate, and the list of private names the package uses.

Ground truth: the floor declared in setup.cfg (the releases CI's floor leg
installs), the message contract (what was found, what is needed), and the
package's source (every private TensorFlow or Keras name it uses, and every
private attribute it writes on an object of another module, is in
`_private_names`).
"""

import configparser
import glob
import os
import re
import subprocess
import sys
import textwrap

import tensorflow as tf
from absl.testing import parameterized

from accum_model.keras import _adapter
from accum_model.keras import _private_names
from accum_model.keras import _versions
from tests import testing_utils as tu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared_requirements():
    """`{name: minimum}` from setup.cfg's install_requires and extras."""
    config = configparser.ConfigParser()
    config.read(os.path.join(_ROOT, "setup.cfg"))
    lines = config["options"]["install_requires"].splitlines()
    for extra in config["options.extras_require"].values():
        lines += extra.splitlines()
    declared = {}
    for line in lines:
        if ">=" in line:
            name, minimum = line.split(">=")
            declared[name.strip()] = minimum.split(",")[0].strip()
    return declared


class CheckVersionsTest(tf.test.TestCase, parameterized.TestCase):
    def test_floor_is_what_setup_cfg_declares(self):
        declared = _declared_requirements()
        self.assertEqual(declared.get("tensorflow"), _versions.MIN_TENSORFLOW)
        self.assertEqual(declared.get("keras"), _versions.MIN_KERAS)
        self.assertEqual(declared.get("tf-keras"), _versions.MIN_TF_KERAS)

    def test_floor_is_what_ci_installs(self):
        with open(os.path.join(_ROOT, ".ci", "floor-constraints.txt")) as f:
            pins = dict(
                line.split("#")[0].strip().split("==")
                for line in f
                if "==" in line.split("#")[0]
            )
        for name, minimum in (
            ("tensorflow", _versions.MIN_TENSORFLOW),
            ("keras", _versions.MIN_KERAS),
            ("tf-keras", _versions.MIN_TF_KERAS),
        ):
            # Same release at the declared precision (2.16 covers 2.16.2).
            floor = _versions.release(minimum)
            self.assertEqual(
                _versions.release(pins[name])[: len(floor)], floor, name
            )

    @parameterized.named_parameters(
        ("floor", "2.16.2", "3.14.0", False),
        ("newer", "2.21.0", "3.15.1", False),
        ("prerelease_of_newer", "2.22.0rc0", "3.16.0.dev2026", False),
        ("tf_keras_floor", "2.16.2", "2.16.0", True),
        ("tf_keras_newer", "2.21.0", "2.21.0", True),
    )
    def test_supported_versions_pass(self, tf_version, keras_version, legacy):
        _versions.check_versions(tf_version, keras_version, legacy)

    @parameterized.named_parameters(
        (
            "old_keras_3",
            "2.16.2",
            "3.3.3",
            False,
            "keras >= 3.14.0 (found 3.3.3)",
        ),
        (
            "keras_2_without_legacy",
            "2.16.2",
            "2.15.0",
            False,
            "found keras 2.15.0; for Keras 2 set TF_USE_LEGACY_KERAS=1",
        ),
        (
            "old_tensorflow",
            "2.15.1",
            "2.15.0",
            False,
            "TensorFlow >= 2.16 (found 2.15.1)",
        ),
        (
            "old_tf_keras",
            "2.16.2",
            "2.15.1",
            True,
            "tf_keras >= 2.16 (found 2.15.1)",
        ),
    )
    def test_too_old_raises_one_clear_import_error(
        self, tf_version, keras_version, legacy, found
    ):
        with self.assertRaises(ImportError) as raised:
            _versions.check_versions(tf_version, keras_version, legacy)
        message = str(raised.exception)
        self.assertStartsWith(message, "accum_model requires ")
        self.assertIn(found, message)
        self.assertIn("pip install", message)

    def test_import_fails_at_import_on_an_old_keras(self):
        # A real import in a fresh interpreter, with the Keras that
        # `tf.keras` resolves to claiming an old release: the user sees the
        # ImportError, before any model is built.
        package = "tf_keras" if tu.TF_KERAS else "keras"
        old = "2.15.1" if tu.TF_KERAS else "3.3.3"
        code = textwrap.dedent(f"""
            import {package}
            {package}.__version__ = "{old}"
            import accum_model
        """)
        env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        self.assertNotEqual(result.returncode, 0, result.stderr)
        last_line = result.stderr.strip().splitlines()[-1]
        self.assertStartsWith(last_line, "ImportError: accum_model requires ")
        self.assertIn(f"(found {old})", last_line)
        self.assertNotIn("AttributeError", result.stderr)


# A private module path: a `src` or `python` package, or a component that
# starts with an underscore (the package's own modules excepted).
_PRIVATE_MODULE = re.compile(
    r"^\s*(?:from|import)\s+((?!accum_model\b)[\w.]*"
    r"(?:\.src\b|\.python\b|\._)[\w.]*)",
    re.MULTILINE,
)
# A private name used: read, called, defined as a method (which may
# override one of Keras'), or read by `getattr`/`hasattr`.
_PRIVATE_ATTRIBUTE = re.compile(
    r"(?:\.|\bdef\s+)(_[A-Za-z]\w*)"
    r"|\b(?:getattr|hasattr)\([^,()]+,\s*[\"\'](_[A-Za-z]\w*)[\"\']"
)
# A private attribute written on an object other than `self` or `cls`.
_WRITE_ELSEWHERE = re.compile(
    r"(?<![\w.])(?!(?:self|cls)\.)[A-Za-z_]\w*(?:\.\w+)*\.(_[A-Za-z]\w*)"
    r"\s*(?:[-+*/]?=)(?!=)"
)


def _owns(source, name):
    """Whether `source` defines `name` as its own.

    Its own: a function or class it defines, a module-level name, an
    attribute its classes set on `self` or `cls` (also with `setattr` or in
    a class namespace it builds).
    """
    n = re.escape(name)
    return bool(
        re.search(rf"\b(?:def|class)\s+{n}\b", source)
        or re.search(rf"\b(?:self|cls)\.{n}\s*=(?!=)", source)
        or re.search(rf"^\s*{n}\s*=(?!=)", source, re.MULTILINE)
        or re.search(rf"setattr\(\s*(?:self|cls)\s*,\s*[\"\']{n}[\"\']", source)
        or re.search(rf"[\"\']{n}[\"\']\s*:", source)
    )


def _keras_and_tensorflow_classes():
    keras = _adapter.keras
    return (
        keras.Model,
        keras.layers.BatchNormalization,
        keras.callbacks.Callback,
        keras.optimizers.Optimizer,
        _adapter.ADAPTER.saveable_base,
        tf.Module,
        tf.Variable,
    )


def _unlisted(module, source, listed):
    """What `module` uses or writes that is private and not in `listed`."""
    classes = _keras_and_tensorflow_classes()
    unlisted = set()
    for name in _PRIVATE_MODULE.findall(source):
        if name not in listed:
            unlisted.add(f"{module}: import {name}")
    # The package's own modules are private by their names only.
    source = re.sub(r"accum_model(?:\.\w+)+", "", source)
    for name in _WRITE_ELSEWHERE.findall(source):
        # On another object: listed, unless the module's own classes set
        # that attribute too (`model._x = ...` beside `self._x = ...`).
        if name not in listed and not _owns(source, name):
            unlisted.add(f"{module}: {name} (written)")
    for match in _PRIVATE_ATTRIBUTE.findall(source):
        name = match[0] or match[1]
        if name.startswith("__") or name in listed:
            continue
        # Keras' or TensorFlow's, though defined here: an override.
        foreign = any(hasattr(c, name) for c in classes)
        if foreign or not _owns(source, name):
            unlisted.add(f"{module}: {name}")
    return sorted(unlisted)


def _package_sources():
    pattern = os.path.join(_ROOT, "accum_model", "**", "*.py")
    for path in sorted(glob.glob(pattern, recursive=True)):
        module = os.path.basename(path)
        if module == "_private_names.py":
            continue  # The list itself.
        with open(path) as f:
            yield module, f.read()


class PrivateNamesTest(tf.test.TestCase):
    def test_private_names_are_listed(self):
        # A grep over the package, the adapter included: every private
        # import, every private attribute that is not the module's own (or
        # is one of Keras' or TensorFlow's, though defined here), and every
        # private attribute written on another module's object must be in
        # `_private_names` for that module. Also fails on one module using
        # another's underscore names: they are not its own.
        unlisted = []
        for module, source in _package_sources():
            listed = _private_names.PRIVATE_NAMES.get(module, {})
            unlisted += _unlisted(module, source, listed)
        self.assertEqual(unlisted, [])

    def test_listed_names_are_used(self):
        # The list stays exact: a name it holds is still used there.
        sources = dict(_package_sources())
        for module, names in _private_names.PRIVATE_NAMES.items():
            self.assertIn(module, sources)
            for name in names:
                # As a whole name: `keras.src` is not used where only
                # `tf_keras.src` is.
                whole = rf"(?<![\w.]){re.escape(name)}\b|\.{re.escape(name)}\b"
                self.assertTrue(
                    re.search(whole, sources[module]), f"{module}: {name}"
                )

    def test_every_listed_name_has_a_reason(self):
        for module, names in _private_names.PRIVATE_NAMES.items():
            for name, why in names.items():
                self.assertGreater(len(why.split()), 3, f"{module}: {name}")

    def test_an_unlisted_private_name_fails(self):
        # The check itself: each kind of private use, added to a module
        # whose list lacks it, is reported.
        source = textwrap.dedent("""
            from keras.src.utils import tracking
            class Hook:
                def _flatten_layers(self):
                    return self._own
                def setup(self):
                    self._own = 1
            def use(model, optimizer):
                model._accum_unlisted = 1
                optimizer.iterations._private_thing
                return getattr(model, "_compile_loss", None)
        """)
        self.assertEqual(
            _unlisted("m.py", source, {}),
            [
                "m.py: _accum_unlisted",
                "m.py: _accum_unlisted (written)",
                "m.py: _compile_loss",
                "m.py: _flatten_layers",
                "m.py: _private_thing",
                "m.py: import keras.src.utils",
            ],
        )
        listed = {
            "keras.src.utils": "why",
            "_accum_unlisted": "why",
            "_compile_loss": "why",
            "_flatten_layers": "why",
            "_private_thing": "why",
        }
        self.assertEqual(_unlisted("m.py", source, listed), [])


if __name__ == "__main__":
    tf.test.main()
