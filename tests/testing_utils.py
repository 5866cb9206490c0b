"""Small models, data and recorders shared by the tests.

The ground truth of every equivalence test is plain `keras.Model` training
with the large batch, started from the same weights.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

from accum_model.keras._adapter import LEGACY
from accum_model.keras._adapter import keras

# Keras 3's optimizers have `gradient_accumulation_steps`; tf_keras' do not.
# The one place the tests learn which Keras generation runs: other test
# modules branch or skip on `TF_KERAS` or `skip_unless_available`.
TF_KERAS = LEGACY
HAS_BUILTIN_ACCUMULATION = not LEGACY

OPTIMIZERS = {
    "sgd": lambda **kw: keras.optimizers.SGD(learning_rate=0.1, **kw),
    "momentum": lambda **kw: keras.optimizers.SGD(
        learning_rate=0.05, momentum=0.9, nesterov=True, **kw
    ),
    "adam": lambda **kw: keras.optimizers.Adam(learning_rate=0.01, **kw),
    "adamw": lambda **kw: keras.optimizers.AdamW(
        learning_rate=0.01, weight_decay=0.1, **kw
    ),
}


def regression_data(n, in_dim=4, out_dim=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    w = rng.normal(size=(in_dim, out_dim)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, out_dim))).astype("float32")
    return x, y


def classification_data(n, in_dim=4, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def mlp(cls, in_dim=4, out_dim=3, hidden=5, seed=0, **kwargs):
    """A two-layer functional MLP of class `cls` with seeded weights."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((in_dim,))
    h = keras.layers.Dense(hidden, activation="tanh")(inputs)
    outputs = keras.layers.Dense(out_dim)(h)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def copy_weights(source, target):
    target.set_weights(source.get_weights())
    return target


class UpdateRecorder(keras.callbacks.Callback):
    """Records the model's weights after every optimizer update."""

    def __init__(self):
        super().__init__()
        self.weights = []
        self._last = None

    def _record_if_updated(self):
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations != self._last:
            self._last = iterations
            self.weights.append([np.array(w) for w in self.model.get_weights()])

    def on_train_begin(self, logs=None):
        self._last = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self._record_if_updated()

    def on_epoch_end(self, epoch, logs=None):
        self._record_if_updated()


def max_abs_diff(a, b):
    """Largest absolute difference between two lists of arrays."""
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} arrays vs {len(b)}")
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        if np.size(x)
        else 0.0
        for x, y in zip(a, b)
    )


def assert_same_trajectory(test, expected, actual, atol=1e-5):
    """Weights after every update agree, update by update."""
    test.assertEqual(len(expected), len(actual), "number of updates")
    for i, (e, a) in enumerate(zip(expected, actual)):
        diff = max_abs_diff(e, a)
        test.assertLessEqual(diff, atol, f"update {i}: max |diff| {diff}")


def trajectory_diff(expected, actual):
    return max(max_abs_diff(e, a) for e, a in zip(expected, actual))


def train(
    model,
    x,
    y,
    batch_size,
    epochs=1,
    optimizer="sgd",
    loss="mse",
    compile_kwargs=None,
    **fit_kwargs,
):
    """Compiles and fits `model`, returning (history, per-update weights)."""
    if isinstance(optimizer, str):
        optimizer = OPTIMIZERS[optimizer]()
    model.compile(optimizer=optimizer, loss=loss, **(compile_kwargs or {}))
    recorder = UpdateRecorder()
    callbacks = [recorder] + list(fit_kwargs.pop("callbacks", []))
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **fit_kwargs,
    )
    return history, recorder.weights


def as_dataset(x, y, batch_size):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def use_policy(test, name):
    """Sets the global dtype policy `name` until `test` ends."""
    keras.mixed_precision.set_global_policy(name)
    test.addCleanup(keras.mixed_precision.set_global_policy, "float32")


def scale_loss(optimizer, loss):
    """`loss` scaled by a LossScaleOptimizer, as its generation's loops do."""
    if LEGACY:
        return optimizer.get_scaled_loss(loss)
    return optimizer.scale_loss(loss)


def gradients_to_apply(optimizer, grads):
    """Gradients of a `scale_loss` loss, as the LossScaleOptimizer takes them.

    Keras 3's `apply` takes them scaled; tf_keras' `apply_gradients` takes
    them through `get_unscaled_gradients`.
    """
    if LEGACY:
        return optimizer.get_unscaled_gradients(grads)
    return grads


def save_and_load(model, path, make_model):
    """Saves `model` to `path` and loads it back, by the path's format.

    A `.keras` file loads as a whole model; a `.weights.h5` file loads into
    `make_model()`, a fresh model compiled as the saved one was.
    """
    if path.endswith(".keras"):
        model.save(path)
        return keras.models.load_model(path)
    model.save_weights(path)
    restored = make_model()
    restored.load_weights(path)
    return restored


def _keras_hub_missing():
    if LEGACY:
        return (
            "keras-hub runs on Keras 3 only; TF_USE_LEGACY_KERAS=1 "
            "selects tf_keras"
        )
    try:
        import keras_hub  # noqa: F401
    except ImportError as e:
        return f"keras-hub is not importable ({e})"
    return None


def skip_unless_available(what):
    """The one way tests skip: a Keras generation or a package missing.

    Args:
        what: `"keras_3"` (Keras 3, not tf_keras), `"tf_keras"` (tf_keras,
            `TF_USE_LEGACY_KERAS=1`) or `"keras_hub"` (keras-hub importable,
            which implies Keras 3).

    Returns:
        A `unittest` skip decorator, or a no-op one, with the reason.
    """
    import unittest

    reasons = {
        "keras_3": "tf_keras (TF_USE_LEGACY_KERAS=1) has no such feature"
        if LEGACY
        else None,
        "tf_keras": None
        if LEGACY
        else "Keras 3 (TF_USE_LEGACY_KERAS=1 selects tf_keras) has no such "
        "feature",
        "keras_hub": _keras_hub_missing(),
    }
    reason = reasons[what]
    return unittest.skipIf(reason is not None, reason)


# Loads each file with `accum_model` made unimportable, as a service that
# only runs inference would, and prints each model's class name and its
# predictions on the JSON inputs.
_LOAD_WITHOUT_ACCUM_MODEL = """
import json, sys
sys.modules["accum_model"] = None
if {legacy}:
    import tf_keras as keras
else:
    import keras
x = json.loads(sys.argv[1])
x = x if isinstance(x[0], str) else __import__("numpy").asarray(x, "float32")
out = {{}}
for path in sys.argv[2:]:
    model = keras.models.load_model(path)
    out[path] = [type(model).__name__, model.predict(x, verbose=0).tolist()]
print(json.dumps(out))
"""


def load_without_accum_model(paths, x):
    """`{path: (class name, predictions)}` of files loaded by Keras alone.

    In a new process where `import accum_model` fails. `x`: a list of
    strings (for a model with a preprocessor) or an array.
    """
    x = x if isinstance(x, list) else np.asarray(x).tolist()
    output = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_WITHOUT_ACCUM_MODEL.format(legacy=LEGACY),
            json.dumps(x),
            *paths,
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=240,
    )
    if output.returncode != 0:
        raise AssertionError(output.stderr[-3000:])
    return json.loads(output.stdout.strip().splitlines()[-1])


class PyFunctionSGD(keras.optimizers.SGD):
    """SGD whose update goes through a `tf.py_function`: XLA cannot compile
    it (the window's update compiled apart refuses it)."""

    def update_step(self, gradient, variable, *args):
        gradient = tf.py_function(lambda g: g, [gradient], gradient.dtype)
        gradient.set_shape(variable.shape)
        return super().update_step(gradient, variable, *args)
