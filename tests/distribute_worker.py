"""Runs training cases under a tf.distribute strategy; writes JSON results.

Started by tests/test_distribute.py (never imported by it): the strategy's
devices must be configured before TensorFlow initializes, which a pytest
process that already ran TensorFlow cannot do.

    python tests/distribute_worker.py --strategy=mirrored \
        --cases=cases.json --output=out.json
    TF_CONFIG=... python tests/distribute_worker.py --strategy=multi_worker ...

`mirrored` is `MirroredStrategy` on 2 logical CPU devices of this process;
`multi_worker` is `MultiWorkerMirroredStrategy` with one CPU replica in each
worker process that `TF_CONFIG` names. Every case reports the weights it
started from and the weights after every optimizer update, plus the
all-reduces it executed (tests/allreduce_counter.py); the test process
computes the single-device reference itself. A case with `loss_scale`
trains under its `policy` with a `LossScaleOptimizer` and also reports the
final loss scale and `skipped_microbatches`.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "strategy",
    "mirrored",
    ["mirrored", "multi_worker"],
    "Which tf.distribute strategy to run the cases under.",
)
flags.DEFINE_string("cases", None, "JSON file with a list of cases.")
flags.DEFINE_string("output", None, "Where to write the JSON results.")


def _make_strategy(name):
    if name == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    from tests import loopback_cluster

    loopback_cluster.configure_coordination(heartbeat_timeout_s=120)
    return tf.distribute.MultiWorkerMirroredStrategy()


def _as_lists(weights):
    return [np.asarray(w).tolist() for w in weights]


def _plain_model_class():
    from accum_model.keras._adapter import ADAPTER
    from accum_model.keras._adapter import keras
    from accum_model.keras._multi_worker import MultiWorkerFitWorkarounds

    class PlainModel(MultiWorkerFitWorkarounds, keras.Model):
        """Keras' own train_step, plus only AccumModel's MWMS workarounds."""

        def train_step(self, data):
            # What `AccumModel.train_step` does to its own logs.
            return ADAPTER.logs_for_replica_reduction(
                self, super().train_step(data)
            )

    return PlainModel


def _unguarded_track_loss(model, loss, batch_size):
    # `Keras3Adapter.track_loss` without its empty-shard guard.
    model._loss_tracker.update_state(
        loss * tf.distribute.get_strategy().num_replicas_in_sync,
        sample_weight=batch_size,
    )


def scalar_mean_squared_error(y_true, y_pred):
    """A loss that reduces itself: NaN on an empty shard (0 / 0).

    Keras 3 leaves a scalar returned by a loss function as it is (its
    `reduce_values`), so under Keras 3 such a loss scales itself for the
    replicas as Keras scales its own; tf_keras scales it.
    """
    from tests import testing_utils as tu

    loss = tf.reduce_mean(tf.square(y_true - y_pred))
    if tu.TF_KERAS:
        return loss
    return loss / tf.distribute.get_strategy().num_replicas_in_sync


LOSSES = {"mse": "mse", "scalar_mse": scalar_mean_squared_error}


# What a case may switch off, to show that each workaround is needed.
_DISABLE = {
    "symbolic_build": (
        "symbolic_build_arguments",
        lambda model, iterator, data_batch: (iterator, data_batch),
    ),
    "logs": ("logs_for_replica_reduction", lambda model, logs: logs),
    "empty_shard_guard": ("track_loss", _unguarded_track_loss),
}


def _fit_case(strategy, case):
    from accum_model.keras._adapter import ADAPTER

    patched = [_DISABLE[name] for name in case.get("disable", [])]
    try:
        for attr, replacement in patched:
            setattr(ADAPTER, attr, replacement)
        return _fit(strategy, case)
    finally:
        for attr, _ in patched:
            delattr(ADAPTER, attr)  # back to the class's method


def _under_policy(run, strategy, case):
    from accum_model.keras._adapter import keras

    policy = keras.mixed_precision.global_policy()
    try:
        if case.get("policy"):
            keras.mixed_precision.set_global_policy(case["policy"])
        return run(strategy, case)
    finally:
        # Later cases in this process run under the policy they started
        # with, also after a failure.
        keras.mixed_precision.set_global_policy(policy)


def _data(case):
    from tests import testing_utils as tu

    x, y = tu.regression_data(case["n"], seed=case.get("seed", 0))
    for index in case.get("overflow", []):
        # Beyond float16's 65504: the micro-batch holding this sample
        # overflows on the one replica whose shard holds it.
        x[index] = 1e6
    for index in case.get("nan", []):
        # A NaN gradient in the one replica whose shard holds this sample.
        x[index] = np.nan
    return x, y


def _optimizer(case):
    """The case's optimizer; call it in the strategy's scope.

    In the scope: Keras 3 creates `iterations` in the constructor, and one
    created outside would count every replica's update.
    """
    from accum_model.keras._adapter import keras
    from tests import testing_utils as tu

    optimizer = tu.OPTIMIZERS[case["optimizer"]]()
    if case.get("loss_scale"):
        optimizer = keras.mixed_precision.LossScaleOptimizer(
            optimizer, initial_scale=case["loss_scale"]
        )
    return optimizer


def _fit(strategy, case):
    from accum_model import AccumModel
    from accum_model.keras._adapter import ADAPTER
    from accum_model.keras._adapter import keras
    from tests import allreduce_counter
    from tests import testing_utils as tu

    replicas = strategy.num_replicas_in_sync
    x, y = _data(case)
    steps = case["steps"]
    fit_kwargs = {}
    if case.get("validation"):
        fit_kwargs["validation_data"] = tu.regression_data(6, seed=7)
    with strategy.scope():
        if case.get("plain") == "keras":
            model = tu.mlp(keras.Model, seed=case.get("seed", 0))
        elif case.get("plain"):
            model = tu.mlp(_plain_model_class(), seed=case.get("seed", 0))
        elif case.get("split"):
            # Each replica splits its shard of the whole global batch.
            # The noise scale changes no update; it shows the slices.
            model = tu.mlp(
                AccumModel,
                seed=case.get("seed", 0),
                micro_batch_size=case["split"],
                noise_scale=True,
            )
        else:
            model = tu.mlp(
                AccumModel,
                seed=case.get("seed", 0),
                accum_steps=steps,
                epoch_end=case.get("epoch_end", "apply"),
            )
        initial = model.get_weights()
        optimizer = _optimizer(case)
        allreduce_counter.reset()
        batch_size = case["micro"] * replicas
        if case.get("split"):
            batch_size *= steps
        if case.get("pipeline") == "filter":
            # A dataset of unknown length: Keras calls the train function
            # once more at each epoch's end, with an iterator that runs dry.
            x = (
                tf.data.Dataset.from_tensor_slices((x, y))
                .filter(lambda a, b: True)
                .batch(batch_size)
            )
            y, batch_size = None, None
        history, trajectory = tu.train(
            model,
            x,
            y,
            batch_size=batch_size,
            epochs=case.get("epochs", 2),
            optimizer=optimizer,
            loss=LOSSES[case.get("loss", "mse")],
            **fit_kwargs,
        )
    extra = {}
    if case.get("loss_scale"):
        extra["loss_scale"] = float(ADAPTER.loss_scale(model.optimizer))
        extra["skipped_microbatches"] = model.skipped_microbatches
    if case.get("nan"):
        extra["discarded_windows"] = model.discarded_windows
    if case.get("split"):
        extra["measurements"] = (
            model.gradient_accumulator.noise_scale.measurements
        )
    return {
        **extra,
        "replicas": replicas,
        "initial": _as_lists(initial),
        "trajectory": [_as_lists(w) for w in trajectory],
        "iterations": int(model.optimizer.iterations.numpy()),
        "history": {
            k: [float(v) for v in vs] for k, vs in history.history.items()
        },
        "allreduces": allreduce_counter.records(),
        "num_variables": len(model.trainable_variables),
    }


def _loop_case(strategy, case):
    """GradientAccumulator in a custom loop: strategy.run per micro-batch."""
    from accum_model import GradientAccumulator
    from accum_model.keras._adapter import ADAPTER
    from tests import allreduce_counter
    from tests import testing_utils as tu

    replicas = strategy.num_replicas_in_sync
    x, y = _data(case)
    scaling = bool(case.get("loss_scale"))
    with strategy.scope():
        model = tu.mlp(tf.keras.Model, seed=case.get("seed", 0))
        optimizer = _optimizer(case)
        accumulator = GradientAccumulator(
            model.trainable_variables, accum_steps=case["steps"]
        )
        # Before the first trace: Keras 3's `scale_loss` multiplies by a
        # constant until its optimizer is built.
        ADAPTER.build_optimizer(optimizer, model.trainable_variables)
    initial = model.get_weights()
    dataset = strategy.experimental_distribute_dataset(
        tu.as_dataset(x, y, case["micro"] * replicas)
    )

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            # The local mean: the accumulator weights it by the local count
            # and divides by the global count at apply.
            y_pred = tf.cast(model(xb, training=True), tf.float32)
            loss = tf.reduce_mean(tf.square(y_pred - yb))
            if scaling:
                loss = tu.scale_loss(optimizer, loss)
        grads = tape.gradient(loss, model.trainable_variables)
        if scaling:
            grads = tu.gradients_to_apply(optimizer, grads)
        return accumulator.step(grads, optimizer, weight=tf.shape(xb)[0])

    @tf.function
    def train_step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    @tf.function
    def flush():
        strategy.run(lambda: accumulator.apply(optimizer))

    def iterations():
        return int(optimizer.iterations.numpy())

    allreduce_counter.reset()
    trajectory = []
    last = iterations()
    for _ in range(case.get("epochs", 2)):
        for xb, yb in dataset:
            train_step(xb, yb)
            if iterations() != last:
                last = iterations()
                trajectory.append(model.get_weights())
        flush()
        if iterations() != last:
            last = iterations()
            trajectory.append(model.get_weights())
    extra = {}
    if scaling:
        extra["loss_scale"] = float(ADAPTER.loss_scale(optimizer))
        extra["skipped_microbatches"] = int(accumulator.skipped_microbatches)
    return {
        **extra,
        "replicas": replicas,
        "initial": _as_lists(initial),
        "trajectory": [_as_lists(w) for w in trajectory],
        "iterations": iterations(),
        "allreduces": allreduce_counter.records(),
        "num_variables": len(model.trainable_variables),
    }


def _noise_scale_case(strategy, case):
    """AccumModel(noise_scale=True) at frozen weights on the exact problem.

    Reports each window's raw estimates (tests/noise_scale_problem.py has
    the population values they must average to); with `case["adascale"]`
    (a base batch) also AdaScale's gain after each window.
    """
    from accum_model import AccumModel
    from accum_model import AdaScale
    from accum_model.keras._adapter import keras
    from tests import allreduce_counter
    from tests import noise_scale_problem as problem

    replicas = strategy.num_replicas_in_sync
    micro = case["micro"] * replicas
    sizes = (micro,) * case["steps"]
    x, y = problem.data()
    xs, ys, _ = problem.window_data(x, y, sizes, case["windows"])
    kernel, bias = problem.frozen_weights()
    with strategy.scope():
        inputs = keras.Input((problem.IN_DIM,))
        outputs = keras.layers.Dense(1)(inputs)
        model = AccumModel(
            inputs=inputs,
            outputs=outputs,
            accum_steps=case["steps"],
            noise_scale=True,
            adascale=(
                AdaScale(case["adascale"]) if case.get("adascale") else None
            ),
        )
        model.set_weights([kernel, bias])
        model.compile(keras.optimizers.SGD(learning_rate=0.0), "mse")
    trace, grad_sq, gains = [], [], []

    class Recorder(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            estimator = self.model.gradient_accumulator.noise_scale
            if estimator.measurements != Recorder.seen:
                Recorder.seen = estimator.measurements
                trace.append(float(estimator.last_trace_sigma))
                grad_sq.append(float(estimator.last_grad_sq_norm))
                if self.model.adascale is not None:
                    gains.append(self.model.adascale_gain)

    allreduce_counter.reset()
    history = model.fit(
        xs,
        ys,
        batch_size=micro,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Recorder()],
    )
    estimator = model.gradient_accumulator.noise_scale
    return {
        "replicas": replicas,
        "trace": trace,
        "grad_sq": grad_sq,
        "micro_batch_weight": float(estimator.micro_batch_weight),
        "logged": [float(v) for v in history.history["gradient_noise_scale"]],
        "b_simple": float(estimator.b_simple),
        "gains": gains,
        "logged_gain": [
            float(v) for v in history.history.get("adascale_gain", [])
        ],
        "tau": model.adascale_tau,
        "iterations": int(model.optimizer.iterations.numpy()),
        "allreduces": allreduce_counter.records(),
        "num_variables": len(model.trainable_variables),
    }


_KINDS = {"loop": _loop_case, "noise_scale": _noise_scale_case}


def main(argv):
    from accum_model.keras._adapter import keras

    config = getattr(keras, "config", None)
    if hasattr(config, "disable_traceback_filtering"):
        config.disable_traceback_filtering()  # full tracebacks in reports
    del argv
    # tf.distribute logs every traced collective at INFO.
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel("ERROR")
    strategy = _make_strategy(FLAGS.strategy)
    from tests import allreduce_counter

    allreduce_counter.install()
    with open(FLAGS.cases) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        run = _KINDS.get(case.get("kind"), _fit_case)
        try:
            results[case["name"]] = _under_policy(run, strategy, case)
        except Exception as e:  # Reported per case; the test fails on it.
            import traceback

            results[case["name"]] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-4000:],
            }
    if FLAGS.output:
        with open(FLAGS.output, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("cases")
    app.run(main)
