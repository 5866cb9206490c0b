"""Gradient traffic and speed under MultiWorkerMirroredStrategy, 2 workers.

Starts 2 worker processes of this script on 127.0.0.1 (free ports,
`TF_CONFIG`), one CPU replica each, and in both trains the same ~21M-parameter
MLP on synthetic data, per configuration:

  plain fit          `keras.Model`, one update per global batch
  AccumModel N       `AccumModel(accum_steps=N)`, N = 1, 4, 8
  Keras built-in N   `keras.Model` with `SGD(gradient_accumulation_steps=N)`
                     (Keras 3 only)

Each configuration runs 2 epochs of `--steps` micro-steps; the second epoch is
timed. Bytes are those the workers' collective all-reduces executed in that
epoch (counted by tests/allreduce_counter.py, the counter the tests use),
divided by its micro-steps. The chief prints the table.

    python benchmarks/bench_distributed.py
    python benchmarks/bench_distributed.py --steps=8 --hidden=512   # quick
"""

import json
import os
import re
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

from tests import loopback_cluster  # noqa: E402

_WORKER_INDEX = flags.DEFINE_integer(
    "worker_index", None, "Internal: run as this worker of the cluster."
)
_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes.")
_STEPS = flags.DEFINE_integer(
    "steps", 16, "Micro-steps per epoch (a multiple of 8)."
)
_BATCH = flags.DEFINE_integer("batch_size", 8, "Micro-batch per replica.")
_INPUT = flags.DEFINE_integer("input_dim", 1024, "Input features.")
_HIDDEN = flags.DEFINE_integer(
    "hidden", 4096, "Width of the two hidden layers (4096: ~21M params)."
)
_ACCUM = flags.DEFINE_list(
    "accum_steps", ["1", "4", "8"], "accum_steps values for AccumModel."
)
_BUILTIN = flags.DEFINE_list(
    "builtin_steps",
    ["8"],
    "gradient_accumulation_steps values for Keras' built-in option.",
)
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds for the whole run.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")


def _launch():
    """Starts the workers, relays the chief's output, always reaps them."""
    start = time.monotonic()
    ports = loopback_cluster.free_ports(_WORKERS.value)
    processes = []
    try:
        for index in range(_WORKERS.value):
            env = dict(os.environ, PYTHONPATH=_ROOT)
            env["TF_CONFIG"] = loopback_cluster.tf_config(ports, index)
            processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        f"--worker_index={index}",
                    ]
                    + sys.argv[1:],
                    env=env,
                    stdout=None if index == 0 else subprocess.DEVNULL,
                    stderr=None if index == 0 else subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + _TIMEOUT.value
        while any(p.poll() is None for p in processes):
            if time.monotonic() > deadline:
                raise SystemExit(f"Timed out after {_TIMEOUT.value} s.")
            if any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(0.5)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
        for p in processes:
            p.wait()
    codes = [p.returncode for p in processes]
    if any(codes):
        raise SystemExit(f"Worker exit codes: {codes}")
    print(f"({time.monotonic() - start:.0f} s in all)")


def _first_line(error):
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras' bold
    for line in text.splitlines():
        if "merge_call" in line:  # what Keras' built-in raises here
            return f"{type(error).__name__}: {line.strip()}"
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _plain_model_class(keras, multi_worker):
    """`keras.Model` with Keras' own train step, able to fit on this cluster.

    Keras 3.15's `fit` fails under MultiWorkerMirroredStrategy on CPU for any
    model, in two places; `AccumModel` works around both inside (see
    docs/distributed.md). The plain model it is compared with gets the same
    two fixes here, or plain fit would not run at all: build from this
    worker's first shard instead of a batch averaged over workers, and give
    scalar logs the leading axis Keras' cross-worker reduction needs. tf_keras
    needs neither.
    """
    import tensorflow as tf

    if not multi_worker or keras.Model.__module__.startswith("tf_keras"):
        return keras.Model

    def with_axis(logs):
        return tf.nest.map_structure(
            lambda v: (
                tf.reshape(v, [1])
                if isinstance(v, (tf.Tensor, tf.Variable)) and v.shape.rank == 0
                else v
            ),
            logs,
        )

    class PlainModel(keras.Model):
        def train_step(self, data):
            return with_axis(super().train_step(data))

        def test_step(self, data):
            return with_axis(super().test_step(data))

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            # Keras' own hook; building needs only shapes and dtypes.
            if iterator is not None:
                for _, _, it in iterator:
                    local = self.distribute_strategy.experimental_local_results
                    data_batch = tf.nest.map_structure(
                        lambda v: (
                            local(v)[0]
                            if isinstance(v, tf.distribute.DistributedValues)
                            else v
                        ),
                        next(it),
                    )
                    iterator = None
                    break
            return super()._maybe_symbolic_build(
                iterator=iterator, data_batch=data_batch
            )

    return PlainModel


def _run_worker():
    import numpy as np
    import tensorflow as tf

    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel("ERROR")
    loopback_cluster.configure_coordination(heartbeat_timeout_s=300)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    from accum_model import AccumModel
    from tests import allreduce_counter

    keras = tf.keras
    # Keras 3's optimizers have `gradient_accumulation_steps`; tf_keras'
    # (TF_USE_LEGACY_KERAS=1) do not.
    builtin = not keras.Model.__module__.startswith("tf_keras")

    allreduce_counter.install()
    replicas = strategy.num_replicas_in_sync
    global_batch = _BATCH.value * replicas
    rng = np.random.default_rng(0)
    samples = global_batch * _STEPS.value
    x = rng.normal(size=(samples, _INPUT.value)).astype("float32")
    y = rng.normal(size=(samples, 10)).astype("float32")

    PlainModel = _plain_model_class(keras, multi_worker=_WORKERS.value > 1)

    def build(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((_INPUT.value,))
        h = keras.layers.Dense(_HIDDEN.value, activation="relu")(inputs)
        h = keras.layers.Dense(_HIDDEN.value, activation="relu")(h)
        outputs = keras.layers.Dense(10)(h)
        return cls(inputs=inputs, outputs=outputs, **kwargs)

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:  # epoch 0 traces and warms up
                allreduce_counter.reset()
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.seconds = time.perf_counter() - self.start
                self.records = allreduce_counter.records()

    configs = [("plain fit", 1, lambda: build(PlainModel), {})]
    configs += [
        (
            f"AccumModel N={n}",
            int(n),
            lambda n=n: build(AccumModel, accum_steps=int(n)),
            {},
        )
        for n in _ACCUM.value
    ]
    if builtin:
        configs += [
            (
                f"Keras built-in N={n}",
                int(n),
                lambda: build(PlainModel),
                {"gradient_accumulation_steps": int(n)},
            )
            for n in _BUILTIN.value
        ]

    rows = []
    for name, n, make, optimizer_kwargs in configs:
        row = {"run": name, "accum_steps": n}
        try:
            with strategy.scope():
                model = make()
                model.compile(
                    optimizer=keras.optimizers.SGD(0.01, **optimizer_kwargs),
                    loss="mse",
                )
            params = model.count_params()
            timer = Timer()
            model.fit(
                x,
                y,
                batch_size=global_batch,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[timer],
            )
            total = sum(b for _, b in timer.records)
            row.update(
                params=params,
                micro_steps_per_s=_STEPS.value / timer.seconds,
                bytes_per_micro_step=total / _STEPS.value,
                all_reduces_per_micro_step=len(timer.records) / _STEPS.value,
                updates=int(model.optimizer.iterations.numpy()),
            )
        except Exception as e:  # A configuration that does not run.
            row["error"] = _first_line(e)
        rows.append(row)
    if _WORKER_INDEX.value == 0:
        _print_table(rows, replicas)
        if _JSON.value:
            with open(_JSON.value, "w") as f:
                json.dump(rows, f, indent=1)


def _print_table(rows, replicas):
    plain = next(
        (r for r in rows if r["run"] == "plain fit" and "error" not in r), None
    )
    params = next((r["params"] for r in rows if "params" in r), 0)
    print(
        f"{len(rows)} runs, {replicas} workers x 1 CPU replica, "
        f"{params / 1e6:.1f}M parameters, micro-batch {_BATCH.value} per "
        f"replica, {_STEPS.value} timed micro-steps each"
    )
    print(
        f"{'run':<22}{'micro-steps/s':>14}{'MB all-reduced/micro-step':>27}"
        f"{'vs plain':>10}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:<22}  fails: {r['error'][:110]}")
            continue
        mb = r["bytes_per_micro_step"] / 1e6
        ratio = ""
        if plain:
            share = r["bytes_per_micro_step"] / plain["bytes_per_micro_step"]
            ratio = f"{share:.3f}"
        print(
            f"{r['run']:<22}{r['micro_steps_per_s']:>14.2f}{mb:>27.2f}"
            f"{ratio:>10}"
        )


def main(argv):
    if _STEPS.value % 8:
        raise ValueError(
            f"`steps` must be a multiple of 8. Received: steps={_STEPS.value}"
        )
    if _WORKER_INDEX.value is None:
        del argv
        _launch()
    else:
        _run_worker()


if __name__ == "__main__":
    app.run(main)
