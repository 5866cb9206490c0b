"""The adapter's version check: one clear ImportError below the floor.

Ground truth: the floor declared in setup.cfg (the releases CI's floor leg
installs) and the message contract (what was found, what is needed).
"""

import configparser
import os
import subprocess
import sys
import textwrap

import tensorflow as tf
from absl.testing import parameterized

from accum_model import _keras
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
        self.assertEqual(declared.get("tensorflow"), _keras.MIN_TENSORFLOW)
        self.assertEqual(declared.get("keras"), _keras.MIN_KERAS)
        self.assertEqual(declared.get("tf-keras"), _keras.MIN_TF_KERAS)

    def test_floor_is_what_ci_installs(self):
        with open(os.path.join(_ROOT, ".ci", "floor-constraints.txt")) as f:
            pins = dict(
                line.split("#")[0].strip().split("==")
                for line in f
                if "==" in line.split("#")[0]
            )
        for name, minimum in (
            ("tensorflow", _keras.MIN_TENSORFLOW),
            ("keras", _keras.MIN_KERAS),
            ("tf-keras", _keras.MIN_TF_KERAS),
        ):
            # Same release at the declared precision (2.16 covers 2.16.2).
            floor = _keras._release(minimum)
            self.assertEqual(
                _keras._release(pins[name])[: len(floor)], floor, name
            )

    @parameterized.named_parameters(
        ("floor", "2.16.2", "3.14.0", False),
        ("newer", "2.21.0", "3.15.1", False),
        ("prerelease_of_newer", "2.22.0rc0", "3.16.0.dev2026", False),
        ("tf_keras_floor", "2.16.2", "2.16.0", True),
        ("tf_keras_newer", "2.21.0", "2.21.0", True),
    )
    def test_supported_versions_pass(self, tf_version, keras_version, legacy):
        _keras.check_versions(tf_version, keras_version, legacy)

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
            _keras.check_versions(tf_version, keras_version, legacy)
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


if __name__ == "__main__":
    tf.test.main()
