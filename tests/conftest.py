"""Makes absl's test machinery work under pytest, and schedules by class."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
from absl import flags  # noqa: E402


def pytest_configure(config):
    del config
    # absltest reads --test_tmpdir; pytest never parses absl flags.
    flags.FLAGS.mark_as_parsed()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # With `-n`, a test class stays in one process: its `setUpClass` (a
    # distributed run, a keras-hub task) runs once. What `--dist loadscope`
    # does, chosen here so that a plain `pytest` runs without pytest-xdist.
    # An explicit other `--dist` (not the default "load") is left alone.
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    return LoadScopeScheduling(config, log)
