"""Makes absl's test machinery work under pytest."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402


def pytest_configure(config):
    del config
    # absltest reads --test_tmpdir; pytest never parses absl flags.
    flags.FLAGS.mark_as_parsed()
