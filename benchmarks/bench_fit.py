"""Does accumulation cost anything? Six models trained side by side.

For each workload and optimizer, in one process, this builds six models
(five under tf_keras, which has no `builtin`) with the same weights and
times `fit` on the same data (made here):

  plain_B    plain `keras.Model.fit` at micro-batch B
  accum      `AccumModel(accum_steps=N)` at micro-batch B
  builtin    plain fit at B with the optimizer's own
             `gradient_accumulation_steps=N` (Keras 3 only)
  plain_NB   plain fit at batch N*B (the large batch it stands for)
  floor      a train step that computes the micro-batch's loss and every
             gradient, then discards them: forward and backward, nothing
             else; no accumulation at micro-batch B can be faster
  accum_again
             a second `AccumModel`, built and timed exactly like `accum`:
             the control. accum/accum_again would be 1.000 on a perfect
             clock; how far it lands from 1 is how far two identical
             contenders differ in this run: the resolution of every other
             ratio of the run (building the six in reverse order moved it
             by no more than its own spread)

and, only when `--contenders` names it:

  split      `AccumModel(micro_batch_size=B)` at batch N*B: each batch
             split inside the train step into N slices of B (a
             `tf.while_loop`), one update per batch, so as many updates as
             `accum` and plain_NB; its ratios split/accum and
             split/plain_NB get a table of their own

Workloads: an MLP of ~5M parameters (optimizer-bound at small B), a small
CNN on 32x32 images (compute-bound) and a small Transformer encoder over
token sequences (its embedding gradients are sparse); SGD and AdamW.

Every contender is traced and warmed up first; then the repeats run
interleaved, each contender once per repeat, in an order rotated by one
each repeat (plain_B accum builtin ..., accum builtin ... plain_B, ...),
each timing one `fit` call of the same number of samples, from its first
batch to the end of the epoch (the epoch-end flush of `AccumModel`
included). Ratios are taken within each repeat, so slow drifts of a
shared machine cancel, and the table gives their median with a
distribution-free confidence interval for it ([low-high]; at least 95%,
from order statistics: with 12 repeats the 3rd smallest and 3rd largest
ratio, 96%). A ratio whose interval holds 1 is not distinguishable from 1
here; the JSON also has min, max and every repeat's ratio.

With `--noise_scale_every=1,8` it adds a contender per value k,
`accum_gns_k<k>`: `AccumModel(accum_steps=N, noise_scale=NoiseScale(every=k))`,
the gradient noise scale measured every k-th window, and the ratio
accum_gns_k<k> / accum (its own table, `--contenders` keeps a run short).
With `--adascale` (SGD only: AdaScale refuses AdamW) it adds
`accum_adascale`: `AccumModel(accum_steps=N, adascale=AdaScale(B))`, whose
ratio to `accum_gns_k1` (when `--noise_scale_every` holds 1) is what the
gain costs on top of the measurement it needs.

With `--baseline=DIR` it adds `accum_baseline`: an `AccumModel` of an
old copy of the package (DIR holds its `accum_model` folder, e.g. from
`git archive REV accum_model | tar -x -C DIR`), imported in this process
under another module name, and the ratio accum / accum_baseline (its own
table): an engine change timed against the code before it in one
interleaved run, with the A/A control beside it.

It also reports the accumulator's memory (every state variable of the
engine, in bytes, against the bytes of the trainable weights), the number of
Python traces of `train_step` for `accum` and `plain_B` over all the `fit`
calls made here.

    python benchmarks/bench_fit.py                  # ~8 min on 2 CPU cores
    python benchmarks/bench_fit.py --quick          # smoke run, seconds
    python benchmarks/bench_fit.py --json out.json --jit_compile=true
    python benchmarks/bench_fit.py --workloads=mlp --baseline=/tmp/old
    python benchmarks/bench_fit.py --workloads=mlp \
        --contenders=plain_NB,accum_again,split     # micro_batch_size

Uses a GPU when TensorFlow sees one (Keras then compiles with XLA by
default; `--jit_compile` overrides it); `--device=cpu` or `--device=gpu`
chooses.
"""

import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import accum_model
from accum_model import AccumModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repeats import median_interval  # noqa: E402
from repeats import rotated  # noqa: E402

keras = tf.keras
# `tf.keras` is tf_keras (Keras 2) when TF_USE_LEGACY_KERAS=1 was set.
TF_KERAS = keras.Model.__module__.startswith("tf_keras")

CONTENDERS = (
    "plain_B",
    "accum",
    "builtin",
    "plain_NB",
    "floor",
    "accum_again",
    "split",
)
# Run only when `--contenders` names them.
OPT_IN = ("split",)
# What `split` is compared with, with column titles.
SPLIT_REFERENCES = {
    "accum": "split / accum",
    "plain_NB": "split / plain_NB",
}
# What `accum` is compared with, in the table's order, with column titles.
REFERENCES = {
    "plain_B": "accum / plain_B",
    "builtin": "accum / built-in",
    "floor": "accum / floor",
    "plain_NB": "accum / plain_NB",
    "accum_again": "A/A: accum / accum_again",
}
WORKLOADS = ("mlp", "cnn", "transformer")
OPTIMIZERS = ("sgd", "adamw")

_WORKLOADS = flags.DEFINE_list(
    "workloads", list(WORKLOADS), f"Which of {WORKLOADS} to run."
)
_OPTIMIZERS = flags.DEFINE_list(
    "optimizers", list(OPTIMIZERS), f"Which of {OPTIMIZERS} to run."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Micro-batch size B.")
_ACCUM_STEPS = flags.DEFINE_integer("accum_steps", 4, "N.")
_REPEATS = flags.DEFINE_integer(
    "repeats",
    12,
    "Interleaved timed repeats per workload and optimizer (a multiple of "
    "the number of contenders, by default "
    f"{len(CONTENDERS) - len(OPT_IN)}, or "
    f"{len(CONTENDERS) - len(OPT_IN) - 1} under tf_keras, runs every "
    "contender equally often in every position).",
)
_SECONDS = flags.DEFINE_float(
    "seconds",
    1.0,
    "Target duration of one timed fit of plain_B; every contender of the "
    "repeat trains on the same number of samples.",
)
_JIT_COMPILE = flags.DEFINE_enum(
    "jit_compile",
    "auto",
    ["auto", "true", "false"],
    "`jit_compile` for `compile` (auto: Keras' default, XLA on GPU only).",
)
_DEVICE = flags.DEFINE_enum(
    "device",
    "auto",
    ["auto", "cpu", "gpu"],
    "Where to train: a GPU when TensorFlow sees one (auto), or force one.",
)
_CLOCK = flags.DEFINE_enum(
    "clock",
    "wall",
    ["wall", "cpu"],
    "What the rates divide by: wall-clock seconds, or CPU seconds of the "
    "process (all threads; steadier than wall time on a machine shared with "
    "other jobs, but it also counts threads that spin waiting for work).",
)
_QUICK = flags.DEFINE_bool(
    "quick",
    False,
    "Tiny models, one repeat, a few steps: checks the program, times "
    "nothing worth reading.",
)
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")
_NOISE_SCALE_EVERY = flags.DEFINE_list(
    "noise_scale_every",
    [],
    "For each k, a contender accum_gns_k<k> measuring the gradient noise "
    "scale every k-th window.",
)
_ADASCALE = flags.DEFINE_bool(
    "adascale",
    False,
    "With the SGD optimizer, a contender accum_adascale: AdaScale at base "
    "batch B (it turns on the noise scale, measured every window).",
)
_CONTENDERS = flags.DEFINE_list(
    "contenders",
    [],
    f"Only these of {CONTENDERS} (plus the accum_gns and baseline ones; "
    "accum is always run). Default: all but the opt-in ones, "
    f"{OPT_IN}.",
)
_BASELINE = flags.DEFINE_list(
    "baseline",
    [],
    "Directories, each holding an old copy of the package (a folder "
    "`accum_model`, e.g. from `git archive REV accum_model | tar -x -C "
    "DIR`), or that folder itself. Each adds a contender `accum_baseline` "
    "(`accum_baseline2`, ... for more): an AccumModel of that copy, loaded "
    "in this process under another module name, timed against `accum`.",
)


# Workloads. Each returns (inputs, outputs, x, y): a functional graph built
# from fresh layers (weights seeded by the caller) and in-memory data.


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer="glorot_uniform",
            name="positions",
        )

    def call(self, x):
        return x + self.positions


def _mlp(quick, samples):
    # 512 -> 2048 -> 2048 -> 10: 5.27M parameters, so at B=32 the optimizer
    # and the accumulator (passes over 5M floats) weigh as much as the math.
    width, features = (64, 32) if quick else (2048, 512)
    inputs = keras.Input((features,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    h = keras.layers.Dense(width, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return inputs, outputs, x, y


def _cnn(quick, samples):
    channels = 4 if quick else 16
    side = 8 if quick else 32
    inputs = keras.Input((side, side, 3))
    h = inputs
    for i in range(2):
        h = keras.layers.Conv2D(
            channels * 2**i, 3, padding="same", activation="relu"
        )(h)
        h = keras.layers.Conv2D(
            channels * 2**i, 3, padding="same", activation="relu"
        )(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    outputs = keras.layers.Dense(10)(h)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, side, side, 3)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return inputs, outputs, x, y


def _transformer(quick, samples):
    # Two pre-norm encoder blocks over 64 tokens; the token embedding's
    # gradient is an IndexedSlices, so the sparse path is measured too.
    vocab, length, dim, heads, blocks = (
        (100, 8, 16, 2, 1) if quick else (4000, 64, 64, 4, 2)
    )
    inputs = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(inputs)
    h = _PositionEmbedding()(h)
    for _ in range(blocks):
        a = keras.layers.LayerNormalization()(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads)(a, a)
        h = keras.layers.Add()([h, a])
        f = keras.layers.LayerNormalization()(h)
        f = keras.layers.Dense(4 * dim, activation="gelu")(f)
        f = keras.layers.Dense(dim)(f)
        h = keras.layers.Add()([h, f])
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(10)(h)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(samples, length)).astype("int32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return inputs, outputs, x, y


_BUILDERS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def _optimizer(name, **kwargs):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.01, **kwargs)
    return keras.optimizers.AdamW(
        learning_rate=1e-3, weight_decay=0.01, **kwargs
    )


# Contenders. Each model class counts the Python traces of its train step.


def _counting(base):
    class Counting(base):
        traces = 0

        def train_step(self, data):
            type(self).traces += 1
            return super().train_step(data)

    return Counting


def _tracked_loss(model, x, y, y_pred, sample_weight):
    """The loss of plain fit's step, logged as plain fit logs it.

    Keras 3's `compute_loss` only computes; `fit` adds it to the "loss"
    metric weighted by the batch size, so the logged loss is a per-sample
    mean. tf_keras' `compute_loss` updates that metric itself.
    """
    if TF_KERAS:
        return model.compute_loss(x, y, y_pred, sample_weight)
    loss = model.compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )
    batch = tf.shape(tf.nest.flatten(x)[0])[0]
    tracker = next(m for m in model.metrics if m.name == "loss")
    tracker.update_state(loss, sample_weight=batch)
    return loss


def _floor_class():
    class Floor(keras.Model):
        """Forward and backward at micro-batch B; the gradients are dropped.

        The step is AccumModel's minus accumulating and applying: the same
        forward pass, loss, loss tracking and metrics, and the gradient of
        every trainable variable. The gradients must feed a value the step
        returns, or TensorFlow drops them (a control dependency is not
        enough: Grappler turns stateless ops that feed only control edges
        into no-ops). So the step returns one element of each gradient,
        summed: a few scalar ops. Under XLA, which could compute a single
        element of a matmul, each gradient is summed whole instead: one
        extra read of every gradient, so there the floor is a little slower
        than the true limit.
        """

        traces = 0

        def train_step(self, data):
            type(self).traces += 1
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = _tracked_loss(self, x, y, y_pred, sample_weight)
            grads = tape.gradient(loss, self.trainable_variables)
            picks = []
            for g in grads:
                if isinstance(g, tf.IndexedSlices):
                    g = g.values
                if g is None:
                    continue
                if self._bench_xla:
                    picks.append(tf.reduce_sum(tf.cast(g, tf.float32)))
                else:
                    picks.append(tf.cast(tf.reshape(g, [-1])[0], tf.float32))
            logs = dict(
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            )
            logs["gradient_checksum"] = tf.add_n(picks)
            return logs

    return Floor


class _Timer(keras.callbacks.Callback):
    """Wall clock and process CPU time from the first batch to epoch end."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.start = (time.perf_counter(), time.process_time())

    def on_epoch_end(self, epoch, logs=None):
        # After AccumModel's flush: its callback runs first.
        self.end = (time.perf_counter(), time.process_time())


def _jit_kwargs():
    value = _JIT_COMPILE.value
    if value == "auto":
        return {}
    return {"jit_compile": value == "true"}


def _uses_xla(model):
    jit = getattr(model, "jit_compile", None)
    if jit is None:
        jit = getattr(model, "_jit_compile", False)
    return bool(jit)


class _Contender:
    def __init__(self, name, model, batch_size):
        self.name = name
        self.model = model
        self.batch_size = batch_size
        self.timer = _Timer()
        self.dataset = None
        self.fit_calls = 0

    def fit(self, steps):
        self.fit_calls += 1
        self.model.fit(
            self.dataset,
            epochs=1,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
            callbacks=[self.timer],
        )
        # (wall seconds, CPU seconds of all the process's threads)
        return tuple(b - a for a, b in zip(self.timer.start, self.timer.end))


def baseline_names(count, kind="accum"):
    """The contenders' names of `count` baseline copies (`split_baseline`:
    their `micro_batch_size` contenders)."""
    return [f"{kind}_baseline{i + 1 if i else ''}" for i in range(count)]


def load_baseline(path, module_name):
    """Imports the copy of the package at `path` as `module_name`.

    The copy's modules import each other as `accum_model.<module>`, which
    would be the current package's; so its `.py` files are copied to a
    temporary folder with every `accum_model` name (imports, and the
    package name its Keras classes are registered under) changed to
    `module_name`, and imported from there. Both packages then live in one
    process, each with its own classes and engine.
    """
    source = os.path.join(path, "accum_model")
    if not os.path.isfile(os.path.join(source, "__init__.py")):
        source = path
    if not os.path.isfile(os.path.join(source, "__init__.py")):
        raise app.UsageError(
            f"`--baseline` must name a folder holding a copy of the package "
            f"(`accum_model/__init__.py`), or that copy. Received: {path!r}"
        )
    root = tempfile.mkdtemp(prefix="bench_fit_baseline_")
    name = re.compile(r"\baccum_model\b")
    for folder, subfolders, files in os.walk(source):
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]
        target = os.path.join(
            root, module_name, os.path.relpath(folder, source)
        )
        os.makedirs(target, exist_ok=True)
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(folder, file)) as f:
                    text = f.read()
                with open(os.path.join(target, file), "w") as f:
                    f.write(name.sub(module_name, text))
    sys.path.insert(0, root)
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(root)


def _contender_names(
    only=(), noise_scale_every=(), adascale=False, baselines=0
):
    names = [c for c in CONTENDERS if not (c == "builtin" and TF_KERAS)]
    if only:
        names = [c for c in names if c in only or c == "accum"]
    else:
        names = [c for c in names if c not in OPT_IN]
    names += [f"accum_gns_k{int(k)}" for k in noise_scale_every]
    names += ["accum_adascale"] if adascale else []
    names += baseline_names(baselines)
    if "split" in names:
        names += baseline_names(baselines, "split")
    return names


def _build_contenders(
    workload,
    optimizer,
    micro,
    n,
    quick,
    samples,
    only=(),
    noise_scale_every=(),
    adascale=False,
    baselines=(),
):
    builder = _BUILDERS[workload]
    contenders = []
    # AdaScale refuses every optimizer but SGD.
    adascale = adascale and optimizer == "sgd"
    names = _contender_names(only, noise_scale_every, adascale, len(baselines))
    packages = dict(zip(baseline_names(len(baselines)), baselines))
    split_packages = dict(
        zip(baseline_names(len(baselines), "split"), baselines)
    )
    for name in names:
        keras.utils.set_random_seed(0)
        inputs, outputs, x, y = builder(quick, samples)
        if name in ("accum", "accum_again"):
            cls, kwargs = _counting(AccumModel), {"accum_steps": n}
        elif name in packages:
            cls = _counting(packages[name].AccumModel)
            kwargs = {"accum_steps": n}
        elif name in split_packages:
            cls = _counting(split_packages[name].AccumModel)
            kwargs = {"micro_batch_size": micro}
        elif name.startswith("accum_gns_k"):
            every = int(name[len("accum_gns_k") :])
            cls, kwargs = (
                _counting(AccumModel),
                {
                    "accum_steps": n,
                    "noise_scale": accum_model.NoiseScale(every=every),
                },
            )
        elif name == "accum_adascale":
            cls, kwargs = (
                _counting(AccumModel),
                {
                    "accum_steps": n,
                    "adascale": accum_model.AdaScale(base_batch=micro),
                },
            )
        elif name == "split":
            # `accum_steps` is 1: one update per batch of N*B.
            cls, kwargs = _counting(AccumModel), {"micro_batch_size": micro}
        elif name == "floor":
            cls, kwargs = _floor_class(), {}
        else:
            cls, kwargs = _counting(keras.Model), {}
        model = cls(inputs=inputs, outputs=outputs, **kwargs)
        opt_kwargs = (
            {"gradient_accumulation_steps": n} if name == "builtin" else {}
        )
        model.compile(
            optimizer=_optimizer(optimizer, **opt_kwargs),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **_jit_kwargs(),
        )
        model._bench_xla = False
        batch = (
            micro * n
            if name == "plain_NB" or name.startswith("split")
            else micro
        )
        contender = _Contender(name, model, batch)
        contender.dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .repeat()
            .batch(batch, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )
        contenders.append(contender)
    return contenders


def _state_bytes(variables):
    return sum(
        int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables
    )


def run_one(
    workload,
    optimizer,
    micro,
    n,
    repeats,
    seconds,
    quick,
    clock="wall",
    only=(),
    noise_scale_every=(),
    adascale=False,
    baselines=(),
):
    """Times the contenders on one workload; returns a result dict."""
    samples = max(8 * micro * n, 512 if not quick else 0)
    contenders = _build_contenders(
        workload,
        optimizer,
        micro,
        n,
        quick,
        samples,
        only,
        noise_scale_every,
        adascale,
        baselines,
    )
    by_name = {c.name: c for c in contenders}

    def micro_steps(c, steps):
        # Every contender trains on `steps * micro` samples per timed fit.
        # plain_NB and the split ones (old copies too) take N*B per step.
        whole = c.name == "plain_NB" or c.name.startswith("split")
        return steps // n if whole else steps

    # Warm up: the first fit traces and builds (Floor learns whether the
    # step is XLA-compiled only after compile resolved `jit_compile`, so it
    # is set before its first trace), the second runs what is timed.
    for c in contenders:
        c.model._bench_xla = _uses_xla(c.model)
        c.fit(micro_steps(c, 2 * n))
    base = by_name["plain_B" if "plain_B" in by_name else "accum"]
    step_time = base.fit(2 * n)[0] / (2 * n)
    if quick:
        steps = n
    else:
        steps = max(2, math.ceil(seconds / max(step_time, 1e-6) / n)) * n
    for c in contenders:
        c.fit(micro_steps(c, n))

    rates = {c.name: [] for c in contenders}
    cpu_rates = {c.name: [] for c in contenders}
    updates_before = {
        c.name: int(c.model.optimizer.iterations) for c in contenders
    }
    for r in range(repeats):
        # Rotate the order each repeat: a contender that always ran right
        # after another (whose garbage, caches and thermal state it
        # inherits) would carry that position's bias into every ratio.
        for c in rotated(contenders, r):
            wall, cpu = c.fit(micro_steps(c, steps))
            rates[c.name].append(steps * micro / wall)
            cpu_rates[c.name].append(steps * micro / max(cpu, 1e-9))
    if clock == "cpu":
        rates, cpu_rates = cpu_rates, rates

    accum = by_name["accum"].model
    engine = accum.gradient_accumulator
    params = _state_bytes(accum.trainable_variables)
    result = {
        "workload": workload,
        "optimizer": optimizer,
        "micro_batch": micro,
        "accum_steps": n,
        "parameters": int(
            sum(np.prod(v.shape) for v in accum.trainable_variables)
        ),
        "xla": _uses_xla(accum),
        "timed_samples_per_fit": steps * micro,
        "clock": clock,
        "samples_per_second": rates,
        # The other clock's rates: samples per second of wall time, or per
        # CPU-second of the process (all threads), whichever `clock` is not.
        "samples_per_second_other_clock": cpu_rates,
        "median_samples_per_second": {
            k: statistics.median(v) for k, v in rates.items()
        },
        "noise_scale": {},
        "baseline": {},
        "ratios": {},
        "memory": {
            "trainable_parameter_bytes": params,
            "accumulator_state_bytes": _state_bytes(engine.state_variables),
        },
        "traces": {
            "accum": type(accum).traces,
            "plain_B": (
                type(by_name["plain_B"].model).traces
                if "plain_B" in by_name
                else None
            ),
            "fit_calls": {c.name: c.fit_calls for c in contenders},
        },
    }
    result["memory"]["accumulator_over_parameters"] = (
        result["memory"]["accumulator_state_bytes"] / params
    )
    if "builtin" in by_name:
        optimizer_obj = by_name["builtin"].model.optimizer
        builtin_vars = getattr(optimizer_obj, "_accumulated_gradients", [])
        result["memory"]["builtin_accumulator_bytes"] = _state_bytes(
            builtin_vars
        )

    def ratio(numerator, denominator):
        per_repeat = [
            a / b for a, b in zip(rates[numerator], rates[denominator])
        ]
        low, high, coverage = median_interval(per_repeat)
        return {
            "median": statistics.median(per_repeat),
            "interval": [low, high],
            "interval_coverage": coverage,
            "min": min(per_repeat),
            "max": max(per_repeat),
            "per_repeat": per_repeat,
        }

    for reference in REFERENCES:
        if reference in rates:
            result["ratios"][f"accum/{reference}"] = ratio("accum", reference)
    # The optimizer's updates in the timed fits: equal for every contender
    # that updates once per N*B samples, which shows each trained on as
    # many.
    result["updates"] = {
        c.name: int(c.model.optimizer.iterations) - updates_before[c.name]
        for c in contenders
    }
    if "split" in by_name:
        for reference in list(SPLIT_REFERENCES) + baseline_names(
            len(baselines), "split"
        ):
            if reference in rates:
                result["ratios"][f"split/{reference}"] = ratio(
                    "split", reference
                )
        model = by_name["split"].model
        result["split"] = {
            "micro_batch_size": model.micro_batch_size,
            "batch_size": by_name["split"].batch_size,
            "updates": int(model.optimizer.iterations),
            "traces": type(model).traces,
            "accumulator_state_bytes": _state_bytes(
                model.gradient_accumulator.state_variables
            ),
        }
    for c in contenders:
        if c.name.startswith("accum_gns_k"):
            estimator = c.model.gradient_accumulator.noise_scale
            result["noise_scale"][c.name] = {
                "ratio_to_accum": ratio(c.name, "accum"),
                "measurements": estimator.measurements,
                "b_simple": float(estimator.b_simple),
                "state_bytes": _state_bytes(estimator.state_variables),
            }
    for name in baseline_names(len(baselines)):
        result["baseline"][name] = {
            "ratio_of_accum": ratio("accum", name),
            "ratio_to_builtin": (
                ratio(name, "builtin") if "builtin" in rates else None
            ),
            "traces": type(by_name[name].model).traces,
            # Where its engine came from: the copy, not this package.
            "engine_module": type(
                by_name[name].model.gradient_accumulator
            ).__module__,
        }
    if "accum_adascale" in by_name:
        model = by_name["accum_adascale"].model
        result["adascale"] = {
            "ratio_to_accum": ratio("accum_adascale", "accum"),
            "ratio_to_gns_k1": (
                ratio("accum_adascale", "accum_gns_k1")
                if "accum_gns_k1" in rates
                else None
            ),
            "gain": model.adascale_gain,
            "state_bytes": _state_bytes(
                model.gradient_accumulator.adascale.state_variables
            ),
        }
    return result


def machine_info():
    gpus = tf.config.list_physical_devices("GPU")
    names = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        names.append(details.get("device_name", gpu.name))
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": names,
        "tensorflow": tf.__version__,
        "keras": importlib.metadata.version(
            "tf_keras" if TF_KERAS else "keras"
        ),
        "keras_generation": 2 if TF_KERAS else 3,
        "accum_model": getattr(accum_model, "__version__", ""),
    }


def _fmt_ratio(r):
    if r is None:
        return "-"
    low, high = r["interval"]
    return f"{r['median']:.3f} [{low:.2f}-{high:.2f}]"


def _interval_label(results):
    coverages = {
        round(100 * v["interval_coverage"])
        for r in results
        for v in r["ratios"].values()
    }
    return "/".join(f"{c}%" for c in sorted(coverages)) or "-"


def format_table(results):
    """The results as a Markdown table (ratios: median [interval])."""
    header = (
        "| workload | optimizer | params | samples/s plain_B | "
        + "".join(f"{title} | " for title in REFERENCES.values())
        + "accumulator / params bytes | traces accum / plain_B |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        ratios = r["ratios"]
        mem = r["memory"]
        lines.append(
            f"| {r['workload']} | {r['optimizer']} | "
            f"{r['parameters'] / 1e6:.2f}M | "
            f"{r['median_samples_per_second']['plain_B']:.0f} | "
            + "".join(
                f"{_fmt_ratio(ratios.get(f'accum/{ref}'))} | "
                for ref in REFERENCES
            )
            + f"{mem['accumulator_over_parameters']:.4f}x | "
            f"{r['traces']['accum']} / {r['traces']['plain_B']} |"
        )
    return "\n".join(lines)


def _markdown(header, rows):
    """A Markdown table: `header`, a list of cells; `rows`, lists of cells."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _aa(r):
    return _fmt_ratio(r["ratios"].get("accum/accum_again"))


def format_noise_table(results):
    """The noise-scale contenders' rates over accum's, as Markdown."""
    return _markdown(
        ["workload", "optimizer", "contender", "samples/s accum"]
        + ["gns / accum", "A/A: accum / accum_again"],
        [
            [
                r["workload"],
                r["optimizer"],
                name,
                f"{r['median_samples_per_second']['accum']:.0f}",
                _fmt_ratio(v["ratio_to_accum"]),
                _aa(r),
            ]
            for r in results
            for name, v in r["noise_scale"].items()
        ],
    )


def format_adascale_table(results):
    """The AdaScale contender's rates over accum's and accum_gns_k1's."""
    return _markdown(
        ["workload", "optimizer", "adascale / accum", "adascale / gns_k1"]
        + ["A/A: accum / accum_again"],
        [
            [
                r["workload"],
                r["optimizer"],
                _fmt_ratio(r["adascale"]["ratio_to_accum"]),
                _fmt_ratio(r["adascale"]["ratio_to_gns_k1"]),
                _aa(r),
            ]
            for r in results
            if "adascale" in r
        ],
    )


def format_baseline_table(results):
    """The current package's rates over each baseline copy's, as Markdown."""
    return _markdown(
        ["workload", "optimizer", "contender", "accum / baseline"]
        + ["baseline / built-in", "accum / built-in"]
        + ["A/A: accum / accum_again"],
        [
            [
                r["workload"],
                r["optimizer"],
                name,
                _fmt_ratio(v["ratio_of_accum"]),
                _fmt_ratio(v["ratio_to_builtin"]),
                _fmt_ratio(r["ratios"].get("accum/builtin")),
                _aa(r),
            ]
            for r in results
            for name, v in r["baseline"].items()
        ],
    )


def format_split_table(results):
    """The split contender's rates over accum's and plain_NB's (and over the
    baseline copies' split), as Markdown."""
    references = dict(SPLIT_REFERENCES)
    for r in results:
        for key in r["ratios"]:
            name = key.split("/", 1)[1]
            if key.startswith("split/") and name not in references:
                references[name] = f"split / {name}"
    return _markdown(
        ["workload", "optimizer", "samples/s split"]
        + list(references.values())
        + ["A/A: accum / accum_again", "traces split"],
        [
            [
                r["workload"],
                r["optimizer"],
                f"{r['median_samples_per_second']['split']:.0f}",
            ]
            + [
                _fmt_ratio(r["ratios"].get(f"split/{ref}"))
                for ref in references
            ]
            + [_aa(r), str(r["split"]["traces"])]
            for r in results
            if "split" in r
        ],
    )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    for name, values, known in (
        ("workloads", _WORKLOADS.value, WORKLOADS),
        ("optimizers", _OPTIMIZERS.value, OPTIMIZERS),
    ):
        unknown = [v for v in values if v not in known]
        if unknown or not values:
            raise app.UsageError(
                f"`--{name}` must be a list of {known}. "
                f"Received: {name}={values!r}"
            )
    unknown = [c for c in _CONTENDERS.value if c not in CONTENDERS]
    if unknown:
        raise app.UsageError(
            f"`--contenders` must be a list of {CONTENDERS}. "
            f"Received: contenders={_CONTENDERS.value!r}"
        )
    if not all(k.isdigit() and int(k) >= 1 for k in _NOISE_SCALE_EVERY.value):
        raise app.UsageError(
            "`--noise_scale_every` must be a list of integers >= 1. "
            f"Received: noise_scale_every={_NOISE_SCALE_EVERY.value!r}"
        )
    gpus = tf.config.list_physical_devices("GPU")
    if _DEVICE.value == "gpu" and not gpus:
        raise app.UsageError(
            "`--device=gpu` was asked for, and no GPU is seen."
        )
    if _DEVICE.value == "cpu":
        tf.config.set_visible_devices([], "GPU")
    # Each model's flush is its own tf.function, traced once; TensorFlow's
    # retracing warning counts them together across the models built here.
    tf.get_logger().setLevel("ERROR")
    baselines = [
        load_baseline(path, f"accum_model_{name}")
        for path, name in zip(
            _BASELINE.value, baseline_names(len(_BASELINE.value))
        )
    ]
    quick = _QUICK.value
    repeats = 1 if quick else _REPEATS.value
    micro = 4 if quick else _BATCH_SIZE.value
    n = 2 if quick else _ACCUM_STEPS.value
    results = []
    started = time.perf_counter()
    for workload in _WORKLOADS.value:
        for optimizer in _OPTIMIZERS.value:
            result = run_one(
                workload,
                optimizer,
                micro,
                n,
                repeats,
                _SECONDS.value,
                quick,
                _CLOCK.value,
                _CONTENDERS.value,
                _NOISE_SCALE_EVERY.value,
                _ADASCALE.value,
                baselines,
            )
            results.append(result)
            print(
                f"{workload} {optimizer}: "
                + ", ".join(
                    f"{k} {_fmt_ratio(v)}" for k, v in result["ratios"].items()
                ),
                flush=True,
            )
    info = machine_info()
    print()
    if "plain_B" in results[0]["median_samples_per_second"]:
        print(format_table(results))
        print()
    if "split" in results[0]:
        print(format_split_table(results))
        print()
    if _NOISE_SCALE_EVERY.value:
        print(format_noise_table(results))
        print()
    if _ADASCALE.value:
        print(format_adascale_table(results))
        print()
    if baselines:
        print(format_baseline_table(results))
        print()
    device = (
        _DEVICE.value != "cpu" and ", ".join(info["gpus"])
    ) or f"CPU ({info['cpu_count']} cores)"
    print(
        f"B={micro}, N={n}, {repeats} interleaved repeats; ratios of "
        f"samples per {_CLOCK.value} second, median [its "
        f"{_interval_label(results)} confidence interval] over repeats; "
        f"{device}, TensorFlow {info['tensorflow']}, "
        f"{'tf_keras' if TF_KERAS else 'Keras'} {info['keras']}; "
        f"{time.perf_counter() - started:.0f} s."
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "flags": {
                        "batch_size": micro,
                        "accum_steps": n,
                        "repeats": repeats,
                        "seconds": _SECONDS.value,
                        "jit_compile": _JIT_COMPILE.value,
                        "clock": _CLOCK.value,
                        "device": _DEVICE.value,
                        "quick": quick,
                    },
                    "contenders": _contender_names(
                        _CONTENDERS.value,
                        _NOISE_SCALE_EVERY.value,
                        _ADASCALE.value,
                        len(baselines),
                    ),
                    "baselines": {
                        name: os.path.abspath(path)
                        for name, path in zip(
                            baseline_names(len(baselines)), _BASELINE.value
                        )
                    },
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    app.run(main)
