"""The version gate: the oldest TensorFlow and Keras the package runs on.

Releases older than `MIN_KERAS` (or `MIN_TF_KERAS`, `MIN_TENSORFLOW`) lack
Keras internals the package uses (`_private_names`); importing the package
there raises one `ImportError` naming what was found and what is needed
(`check_versions`, called by `_keras` as it loads).
"""

import re

# The oldest releases the package is tested with (CI's floor leg); also the
# bounds in setup.cfg and the pins of .ci/floor-constraints.txt.
MIN_TENSORFLOW = "2.16"
MIN_KERAS = "3.14.0"
MIN_TF_KERAS = "2.16"


def release(version):
    """`"3.14.0rc1"` -> `(3, 14, 0)`: the leading numeric release."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        return ()
    return tuple(int(part) for part in match.group(0).split("."))


def check_versions(tensorflow_version, keras_version, legacy):
    """Raises ImportError if this TensorFlow or Keras is too old.

    Args:
        tensorflow_version: `tf.__version__`.
        keras_version: `__version__` of the Keras that `tf.keras` is:
            `keras` (Keras 3), or `tf_keras` when `legacy`.
        legacy: Whether `tf.keras` is tf_keras (TF_USE_LEGACY_KERAS=1).

    Raises:
        ImportError: Naming what was found and what is needed.
    """
    if legacy:
        package, needed = "tf_keras", MIN_TF_KERAS
        install = f'pip install "tf-keras>={needed}"'
    else:
        package, needed = "keras", MIN_KERAS
        install = f'pip install "keras>={needed}"'
    too_old = []
    if release(tensorflow_version) < release(MIN_TENSORFLOW):
        too_old.append(
            f"TensorFlow >= {MIN_TENSORFLOW} (found {tensorflow_version})"
        )
        install = f'pip install "tensorflow>={MIN_TENSORFLOW}"'
    elif not legacy and release(keras_version) < (3,):
        # TensorFlow >= 2.16 installs Keras 3; Keras 2 here is a broken
        # environment or a `keras` pinned below 3.
        too_old.append(
            f"Keras >= {needed} (found keras {keras_version}; for Keras 2 "
            "set TF_USE_LEGACY_KERAS=1 and install tf_keras)"
        )
    elif release(keras_version) < release(needed):
        too_old.append(f"{package} >= {needed} (found {keras_version})")
    if too_old:
        raise ImportError(
            "accum_model requires " + " and ".join(too_old) + ". "
            f"Install a supported version, e.g. `{install}`."
        )


def check_tensorflow(tensorflow_version):
    """Raises ImportError before `tf.keras` is read on a too old TensorFlow.

    There `tf.keras` is Keras 2 whatever is installed, and the adapter
    cannot load to ask which Keras it is.
    """
    if release(tensorflow_version) < release(MIN_TENSORFLOW):
        check_versions(tensorflow_version, "", legacy=False)
