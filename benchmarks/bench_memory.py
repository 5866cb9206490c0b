"""When does accumulation save memory? Peaks of real-size models, measured.

For each model and optimizer this trains, each configuration in its own
process (a peak is per process), from random weights on random data made
here (nothing is downloaded):

  plain_E    plain `fit` at the effective batch E (what accumulation
             stands for)
  plain_B    plain `fit` at the micro-batch B = E / N, N the largest asked
             for (what fits without accumulation)
  accum_N    `accumulate(model, N)` at B = E / N, for each N of
             `--accum_steps`
  builtin_N  plain `fit` at B with the optimizer's own
             `gradient_accumulation_steps=N` (Keras 3)
  split_N    `accumulate(model, micro_batch_size=B)`, `fit` at E: each
             batch split inside the train step into N slices of B, for
             each N of `--accum_steps` (only when `--runs` names `split`)
  auto       `accumulate(model, micro_batch_size="auto")`, `fit` at E
             with nothing limiting memory: whole batches, one slice each
             (only when `--runs` names `auto`)

Models: GPT-2 124M (keras-hub `GPT2Backbone` at the base configuration, with
the causal LM head tied to the token embedding), GPT-2 with LoRA (keras-hub's
`enable_lora`, rank 4, on the attention's query and value), a BERT-base
classifier (keras-hub, 2 classes) and ResNet-50 (`keras.applications`,
`weights=None`, 1000 classes).

Each configuration trains 1 + `--windows` windows (one optimizer update
each) in one `fit`: the first warms up (tracing, the optimizer's variables),
and each of the others is measured: the allocator's peak from its first
micro-batch to its end (weights, optimizer slots and accumulators included:
they are alive). A configuration's peak is the largest of its windows' (how
the two threads interleave a step's ops moves a window's peak by a few
percent), its samples per second are over all of them.

Then it fits the memory model of `docs/memory.md` per model and optimizer:
the static bytes (weights, gradients, optimizer slots, accumulators) from the
variables' sizes and dtypes, which gradients are sparse from the tape, the
activations per sample and a constant from the two plain runs (the slope and
intercept of peak against batch size), and prints each row's prediction
against its measurement, and the crossover: the
smallest effective batch at which accumulating N micro-batches peaks lower
than the plain large batch. With `split` rows it also prints plain_E,
accum_N and split_N side by side, each measured and predicted (n/a where
the model has no prediction: no plain pair to fit it to).

    python benchmarks/bench_memory.py                    # README table
    python benchmarks/bench_memory.py --models=bert,resnet50
    python benchmarks/bench_memory.py --models=resnet50 --accum_steps=1,2,4,8,16
    python benchmarks/bench_memory.py --optimizers=adamw,sgd --json out.json
    python benchmarks/bench_memory.py --models=resnet50 --jit_compile=true
    python benchmarks/bench_memory.py --device=gpu --jit_compile=auto
    python benchmarks/bench_memory.py --models=gpt2,resnet50 \
        --runs=plain_E,plain_B,accum,split          # micro_batch_size
    python benchmarks/bench_memory.py --report=a.json,b.json
    python benchmarks/bench_memory.py --quick            # tiny models, smoke

Memory is read from `tf.config.experimental.get_memory_info`: the BFC
allocator's statistics on the CPU (switched on for each process), the GPU's
allocator on a GPU.
"""

import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

from absl import app
from absl import flags

# The checkout this file is in is what it measures (not an installed copy),
# and its examples hold the memory helper shared with `examples/train.py`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [
    _ROOT,
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(_ROOT, "examples"),
]
import peak_memory  # noqa: E402
from repeats import rotated  # noqa: E402

MODELS = ("gpt2", "gpt2_lora", "bert", "resnet50", "mlp")
OPTIMIZERS = ("adamw", "sgd")
RUNS = ("plain_E", "plain_B", "accum", "builtin", "split", "auto")
# Run only when `--runs` names them.
OPT_IN_RUNS = ("split", "auto")
LORA_RANK = 4
# The weight-dominated model: five hidden layers of MLP_WIDTH, 20 MiB of
# float32 weights, whose activations are small beside them.
MLP_WIDTH = 1024
MLP_DEPTH = 5
MIB = 2**20

_MODELS = flags.DEFINE_list(
    "models",
    ["gpt2", "gpt2_lora"],
    f"Which of {MODELS}. The default is the README's table.",
)
_OPTIMIZERS = flags.DEFINE_list(
    "optimizers", ["adamw"], f"Which of {OPTIMIZERS}."
)
_RUNS = flags.DEFINE_list(
    "runs",
    [r for r in RUNS if r not in OPT_IN_RUNS],
    f"Which of {RUNS}; accum and split run once per `--accum_steps`, "
    "plain_B and builtin at the smallest micro-batch, E divided by the "
    "largest of them.",
)
_BUILTIN_MODELS = flags.DEFINE_list(
    "builtin_models",
    ["gpt2"],
    "The models that also run builtin (when `--runs` has it).",
)
_EFFECTIVE_BATCH = flags.DEFINE_integer(
    "effective_batch", 16, "E: samples per optimizer update."
)
_ACCUM_STEPS = flags.DEFINE_list(
    "accum_steps", ["4"], "The N to accumulate over (each divides E)."
)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 128, "Tokens per sample (GPT-2, BERT)."
)
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", 224, "Image side in pixels (ResNet-50)."
)
_WINDOWS = flags.DEFINE_integer(
    "windows",
    3,
    "Measured windows per configuration after the warm-up one: the peak is "
    "their largest, the samples/s figure their mean.",
)
_JIT_COMPILE = flags.DEFINE_enum(
    "jit_compile",
    "false",
    ["false", "true", "auto"],
    "`compile(jit_compile=...)`: graph mode with no XLA at all (false, "
    "AccumModel's update included), XLA (true), or Keras' choice (auto: "
    "XLA on a GPU; on a CPU graph mode, AccumModel's update compiled apart).",
)
_DEVICE = flags.DEFINE_enum(
    "device",
    "auto",
    list(peak_memory.DEVICES),
    "Where to train: a GPU when TensorFlow sees one (auto), or force one.",
)
_JOBS = flags.DEFINE_integer(
    "jobs",
    1,
    "Configurations run at once (their peaks stay apart, their speeds do "
    "not: more than 1 only for smoke runs).",
)
_QUICK = flags.DEFINE_bool(
    "quick",
    False,
    "Tiny models and batches: checks the program, measures nothing worth "
    "reading.",
)
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")
_BASELINE = flags.DEFINE_string(
    "baseline",
    None,
    "A folder holding another copy of the package (`accum_model/`, e.g. "
    "from `git archive OLD accum_model | tar -x -C DIR`): its `accum` and "
    "`split` rows run too, each right after this checkout's, labelled "
    "`@baseline`, so old and new are measured in one run.",
)
_REPEATS = flags.DEFINE_integer(
    "repeats",
    1,
    "Processes per configuration, each repeat running them all in an "
    "order rotated by one: a row's peak is the median of its processes' "
    "(their range beside it).",
)
_REPORT = flags.DEFINE_list(
    "report",
    None,
    "Measure nothing: print the tables of the rows in these `--json` files "
    "(one model's runs may be split among them).",
)


# The models, built in the worker process. Each returns (model, x, y) with
# `x` and `y` holding `samples` samples.


def _gpt2_config(quick):
    if quick:
        return dict(
            vocabulary_size=1000,
            num_layers=2,
            num_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
        )
    return dict(
        vocabulary_size=50257,
        num_layers=12,
        num_heads=12,
        hidden_dim=768,
        intermediate_dim=3072,
    )


def _tokens(np, rng, samples, length, vocabulary):
    return {
        "token_ids": rng.integers(0, vocabulary, (samples, length)).astype(
            "int32"
        ),
        "padding_mask": np.ones((samples, length), "int32"),
    }


def _gpt2(config, samples, lora=False):
    import keras_hub
    import numpy as np

    arch = _gpt2_config(config["quick"])
    length = config["sequence_length"]
    backbone = keras_hub.models.GPT2Backbone(
        max_sequence_length=max(length, 1024 if not config["quick"] else 16),
        **arch,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(LORA_RANK)
    rng = np.random.default_rng(0)
    vocabulary = arch["vocabulary_size"]
    x = _tokens(np, rng, samples, length, vocabulary)
    y = rng.integers(0, vocabulary, (samples, length)).astype("int32")
    return model, x, y


def _bert(config, samples):
    import keras_hub
    import numpy as np

    quick = config["quick"]
    length = config["sequence_length"]
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000 if quick else 30522,
        num_layers=2 if quick else 12,
        num_heads=2 if quick else 12,
        hidden_dim=32 if quick else 768,
        intermediate_dim=64 if quick else 3072,
        max_sequence_length=max(length, 512 if not quick else 16),
    )
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=None
    )
    rng = np.random.default_rng(0)
    x = _tokens(np, rng, samples, length, 1000 if quick else 30522)
    x["segment_ids"] = np.zeros_like(x["token_ids"])
    y = rng.integers(0, 2, (samples,)).astype("int32")
    return model, x, y


def _resnet50(config, samples):
    import keras
    import numpy as np

    side = config["image_size"]
    model = keras.applications.ResNet50(
        weights=None, input_shape=(side, side, 3), classes=1000
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, side, side, 3)).astype("float32")
    y = rng.integers(0, 1000, (samples,)).astype("int32")
    return model, x, y


def _mlp(config, samples):
    import keras
    import numpy as np

    width = 64 if config["quick"] else MLP_WIDTH
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(MLP_DEPTH):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, width)).astype("float32")
    y = rng.integers(0, 10, (samples,)).astype("int32")
    return model, x, y


def _build(config, samples):
    name = config["model"]
    if name == "mlp":
        return _mlp(config, samples)
    if name == "gpt2":
        return _gpt2(config, samples)
    if name == "gpt2_lora":
        return _gpt2(config, samples, lora=True)
    if name == "bert":
        return _bert(config, samples)
    return _resnet50(config, samples)


def _bytes(variables):
    import numpy as np

    return int(
        sum(
            np.prod(v.shape)
            * np.dtype(getattr(v.dtype, "name", v.dtype)).itemsize
            for v in variables
        )
    )


def _sparse_gradient_variables(tf, model, x, y, loss):
    """The trainable variables whose gradient is a `tf.IndexedSlices`.

    An embedding looked up and not used elsewhere gets the rows of the batch
    as its gradient, not a dense tensor: plain fit never holds that gradient
    at its variable's size, while an accumulator is always dense. Asked of
    the tape, on one sample, after the measured window.
    """
    one = tf.nest.map_structure(lambda t: t[:1], x)
    with tf.GradientTape() as tape:
        value = loss(y[:1], model(one, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    return [
        v
        for v, g in zip(model.trainable_variables, grads)
        if isinstance(g, tf.IndexedSlices)
    ]


def measure(config, queue):
    """Trains one configuration in this process; puts its measurements.

    Args:
        config: A dict: model, optimizer, run, micro_batch, accum_steps,
            sequence_length, image_size, windows, jit_compile, device,
            quick. For `split` `fit` takes batches of `micro_batch *
            accum_steps` and splits each in slices of `micro_batch`.
        queue: Where the result dict goes.
    """
    began = time.perf_counter()
    peak_memory.prepare_process(config["device"])
    if config.get("baseline"):
        # This process measures that copy of the package instead.
        sys.path.insert(0, config["baseline"])
    import keras
    import tensorflow as tf

    import accum_model

    tf.get_logger().setLevel("ERROR")
    device = peak_memory.memory_device(tf, config["device"])
    run, n, micro = config["run"], config["accum_steps"], config["micro_batch"]
    # Batches per update, and the rows of each.
    window = n if run in ("accum", "builtin") else 1
    batch = micro * n if run in ("split", "auto") else micro
    steps = window * (1 + config["windows"])
    keras.utils.set_random_seed(0)
    model, x, y = _build(config, batch * steps)
    optimizer_kwargs = (
        {"gradient_accumulation_steps": n} if run == "builtin" else {}
    )
    if config["optimizer"] == "adamw":
        optimizer = keras.optimizers.AdamW(1e-4, **optimizer_kwargs)
    else:
        optimizer = keras.optimizers.SGD(1e-3, **optimizer_kwargs)
    if run == "accum":
        accum_model.accumulate(model, n)
    elif run == "split":
        accum_model.accumulate(model, micro_batch_size=micro)
    elif run == "auto":
        accum_model.accumulate(model, micro_batch_size="auto")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile={"false": False, "true": True}.get(
            config["jit_compile"], "auto"
        ),
    )
    resident = tf.config.experimental.get_memory_info(device)["current"]

    class Window(keras.callbacks.Callback):
        """Reads and resets the peak at each window's start; times them."""

        def on_train_begin(self, logs=None):
            self.peaks = []

        def on_train_batch_begin(self, batch, logs=None):
            if batch and batch % window == 0:
                self.peaks.append(
                    tf.config.experimental.get_memory_info(device)["peak"]
                )
                tf.config.experimental.reset_memory_stats(device)
                if batch == window:
                    self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == steps - 1:
                # The window closed in this batch. Reading a variable waits
                # for the step on an asynchronous device; the epoch's end
                # would also time AccumModel's epoch-end function, traced
                # there.
                int(model.optimizer.iterations)
                self.seconds = time.perf_counter() - self.start

    clock = Window()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(dataset, epochs=1, verbose=0, callbacks=[clock])
    info = tf.config.experimental.get_memory_info(device)
    # The warm-up window's peak, then each measured window's.
    warm_up_peak, *peaks = clock.peaks + [info["peak"]]
    trainable = model.trainable_variables
    sparse = _sparse_gradient_variables(tf, model, x, y, model.loss)
    builtin = getattr(optimizer, "_accumulated_gradients", [])
    builtin_ids = {id(v) for v in builtin}
    queue.put(
        {
            **config,
            "device_name": device,
            "peak_bytes": max(peaks),
            "window_peak_bytes": peaks,
            "warm_up_peak_bytes": warm_up_peak,
            "resident_before_fit_bytes": resident,
            "resident_after_fit_bytes": info["current"],
            "samples_per_second": batch * (steps - window) / clock.seconds,
            "fit_batch": batch,
            "input_bytes_per_sample": sum(
                a.nbytes for a in tf.nest.flatten((x, y))
            )
            / (batch * steps),
            "process_seconds": time.perf_counter() - began,
            "updates": int(model.optimizer.iterations),
            "parameters": int(model.count_params()),
            "trainable_parameters": int(
                sum(int(tf.size(v)) for v in trainable)
            ),
            "weight_bytes": _bytes(model.weights),
            "trainable_bytes": _bytes(trainable),
            "sparse_gradient_bytes": _bytes(sparse),
            "optimizer_slot_bytes": _bytes(
                v
                for v in optimizer.variables
                if len(v.shape) > 0 and id(v) not in builtin_ids
            ),
            "accumulator_bytes": (
                _bytes(model.gradient_accumulator.state_variables)
                if run in ("accum", "split", "auto")
                else _bytes(builtin)
            ),
        }
    )


def configurations(
    models, optimizers, runs, effective, accum_steps, base, builtin_models=()
):
    """The configurations to measure, in order, as dicts for `measure`.

    `plain_B` and `builtin` run at the smallest micro-batch, E divided by the
    largest N; `split` at E, in slices of E / N.
    """
    largest = max(accum_steps)
    configs = []
    for model in models:
        for optimizer in optimizers:
            rows = []
            if "plain_E" in runs:
                rows.append(("plain_E", effective, 1))
            if "plain_B" in runs:
                rows.append(("plain_B", effective // largest, 1))
            if "accum" in runs:
                rows += [("accum", effective // n, n) for n in accum_steps]
            if "builtin" in runs and model in builtin_models:
                rows.append(("builtin", effective // largest, largest))
            if "split" in runs:
                rows += [("split", effective // n, n) for n in accum_steps]
            if "auto" in runs:
                rows.append(("auto", effective, 1))
            for run, micro, n in rows:
                configs.append(
                    dict(
                        base,
                        model=model,
                        optimizer=optimizer,
                        run=run,
                        micro_batch=micro,
                        accum_steps=n,
                    )
                )
    return configs


def label(row):
    """`plain_E`, `plain_B`, `accum_N`, `builtin_N` or `split_N`.

    With `@baseline` after it for a row of the `--baseline` copy.
    """
    suffix = "@baseline" if row.get("baseline") else ""
    if row["run"].startswith("plain"):
        return row["run"]
    if row["run"] == "auto":
        return f"auto{suffix}"
    return f"{row['run']}_{row['accum_steps']}{suffix}"


def with_baseline(configs, baseline):
    """`configs`, each of this package's followed by its baseline twin."""
    if not baseline:
        return configs
    out = []
    for config in configs:
        out.append(config)
        if config["run"] in ("accum", "split", "auto"):
            out.append(dict(config, baseline=baseline))
    return out


def memory_model(rows):
    """Fits the memory model per model and optimizer; predicts every row.

    A peak is the static bytes plus `a * b` (the activations of a micro-batch
    of `b` samples) plus a constant `c`, plus for `split` the inputs of the
    whole batch (`batch_input_bytes`). The static bytes come from the
    variables' sizes (see `static_bytes`). `a` and `c` come from the two
    plain runs of the same model and optimizer. Sets `predicted_bytes` on
    every row of a group that has both (but a `split` row that does not
    say its inputs' size), and `fitted` on those two.

    Args:
        rows: The measured rows (dicts from `measure`), changed in place.

    Returns:
        A list of dicts, one per model and optimizer with both plain runs:
        the terms of the model, and for each N measured the smallest
        effective batch at which accumulating (AccumModel, built-in,
        `micro_batch_size`) peaks below the plain large batch.
    """
    fits = []
    groups = {}
    for row in rows:
        groups.setdefault((row["model"], row["optimizer"]), []).append(row)
    for (model, optimizer), group in groups.items():
        by = {label(r): r for r in group}
        if "plain_E" not in by or "plain_B" not in by:
            continue
        large, small = by["plain_E"], by["plain_B"]
        if large["micro_batch"] == small["micro_batch"]:
            continue
        per_sample = (large["peak_bytes"] - small["peak_bytes"]) / (
            large["micro_batch"] - small["micro_batch"]
        )
        constant = (
            small["peak_bytes"]
            - static_bytes(small)
            - per_sample * small["micro_batch"]
        )
        for r in group:
            inputs = batch_input_bytes(r)
            if inputs is None:
                continue
            r["predicted_bytes"] = (
                static_bytes(r)
                + per_sample * r["micro_batch"]
                + constant
                + inputs
            )
            r["fitted"] = r is large or r is small
        gradients = large["trainable_bytes"]
        accumulators = max(
            (r["accumulator_bytes"] for r in group if r["run"] == "accum"),
            default=gradients,
        )

        def holds(run):
            # Beside the weights and slots, at this model's sizes.
            r = dict(large, run=run, accumulator_bytes=accumulators)
            if run.startswith("plain"):
                r["accumulator_bytes"] = 0
            return (
                static_bytes(r)
                - large["weight_bytes"]
                - large["optimizer_slot_bytes"]
            )

        held = holds("plain_E")
        ns = sorted({r["accum_steps"] for r in group if r["run"] != "plain_E"})

        def crossover(extra, per_effective_sample=0.0):
            # Accumulating N saves memory once the activations of the N - 1
            # micro-batches it avoids, a * E * (1 - 1/N), outweigh what it
            # holds in addition to plain fit (for `split`, also what grows
            # with E: the whole batch's inputs). Never, where they do not.
            return {
                n: max(extra, 0)
                / (per_sample * (1 - 1 / n) - per_effective_sample)
                for n in ns
                if n > 1 and per_sample * (1 - 1 / n) > per_effective_sample
            }

        input_per_sample = large.get("input_bytes_per_sample")

        fits.append(
            {
                "model": model,
                "optimizer": optimizer,
                "weight_bytes": large["weight_bytes"],
                "gradient_bytes": gradients,
                "sparse_gradient_bytes": large.get("sparse_gradient_bytes", 0),
                "plain_gradient_bytes": held,
                "optimizer_slot_bytes": large["optimizer_slot_bytes"],
                "accumulator_bytes": accumulators,
                "activation_bytes_per_sample": per_sample,
                "constant_bytes": constant,
                "input_bytes_per_sample": input_per_sample,
                "crossover_effective_batch": {
                    "accum": crossover(holds("accum") - held),
                    "builtin": crossover(holds("builtin") - held),
                    "split": (
                        {}
                        if input_per_sample is None
                        else crossover(holds("split") - held, input_per_sample)
                    ),
                },
                "effective_batch": large["micro_batch"],
            }
        )
    return fits


# How many copies of the dense gradients plain fit holds at its peak, per
# optimizer. Keras updates each variable as soon as its gradient exists, in
# the backward pass. SGD's update is one multiply-subtract that frees the
# gradient; AdamW's builds new moments and a step, temporaries the size of
# the variable, for many variables at once: about one more copy.
PLAIN_GRADIENT_COPIES = {"adamw": 1, "sgd": 0}


def static_bytes(row):
    """Weights, optimizer slots, accumulators, and gradients alive at once.

    Plain fit holds `PLAIN_GRADIENT_COPIES` of the dense gradients; a sparse
    one (the looked-up rows of an embedding) grows with the batch and counts
    with the activations. The built-in option holds its optimizer's copies
    and builds `g + acc`, dense, for every variable before it stores the
    first. `AccumModel` adds each gradient into its accumulator as the
    backward pass produces it, which frees it, and runs the optimizer after
    the backward pass; its accumulators are dense. Under XLA, which
    schedules the whole step, its gradients live as long as plain fit's.
    `micro_batch_size` (`split`, and `auto` in one slice) adds each slice's
    gradients into the same accumulators the same way: it holds what
    `AccumModel` holds (and, for `split`, the whole batch's inputs:
    `batch_input_bytes`).
    """
    dense = row["trainable_bytes"] - row.get("sparse_gradient_bytes", 0)
    held = PLAIN_GRADIENT_COPIES[row["optimizer"]] * dense
    xla = row.get("jit_compile", "false") == "true"
    gradients = {
        "accum": held if xla else 0,
        "builtin": held + row["trainable_bytes"],
        "split": held if xla else 0,
        "auto": held if xla else 0,
    }.get(row["run"], held)
    return (
        row["weight_bytes"]
        + row["optimizer_slot_bytes"]
        + row["accumulator_bytes"]
        + gradients
    )


def batch_input_bytes(row):
    """The whole batch's inputs and labels a `split` row holds, or None.

    A `split` row holds its batch, E rows, while its slices run, beside the
    activations of one slice (`a * b`): bytes per sample times E. None where
    the row does not say its inputs' size; 0 for the other runs, whose batch
    is their micro-batch.
    """
    if row["run"] != "split":
        return 0
    per_sample = row.get("input_bytes_per_sample")
    if per_sample is None:
        return None
    return per_sample * row["micro_batch"] * row["accum_steps"]


def _mib(value):
    return f"{value / MIB:,.0f}"


def _peak(row):
    """The row's peak in MiB, with its processes' range when it has one."""
    peaks = row.get("peak_bytes_repeats", [])
    if len(peaks) < 2:
        return _mib(row["peak_bytes"])
    return f"{_mib(row['peak_bytes'])} ({_mib(peaks[0])}-{_mib(peaks[-1])})"


def format_rows(rows):
    """The measured rows as a Markdown table."""
    lines = [
        "| model | optimizer | run | micro-batch | trainable params | "
        "peak MiB | predicted MiB | error | samples/s | speed / plain_E |",
        "|---" * 10 + "|",
    ]
    speeds = {
        (r["model"], r["optimizer"]): r["samples_per_second"]
        for r in rows
        if r["run"] == "plain_E"
    }
    for r in rows:
        predicted = r.get("predicted_bytes")
        fitted = r.get("fitted", False)
        error = (
            "-"
            if predicted is None
            else "fitted"
            if fitted
            else f"{(predicted - r['peak_bytes']) / r['peak_bytes']:+.1%}"
        )
        plain = speeds.get((r["model"], r["optimizer"]))
        speed = (
            "-" if plain is None else f"{r['samples_per_second'] / plain:.2f}"
        )
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {label(r)} | "
            f"{r['micro_batch']} | {r['trainable_parameters'] / 1e6:.2f}M | "
            f"{_peak(r)} | "
            f"{'-' if predicted is None else _mib(predicted)} | {error} | "
            f"{r['samples_per_second']:.2f} | "
            f"{speed} |"
        )
    return "\n".join(lines)


def format_fits(fits):
    """The memory model's terms and crossovers as a Markdown table."""
    lines = [
        "| model | optimizer | weights | gradients (sparse; plain fit "
        "holds) | optimizer slots | accumulators | activations / sample | "
        "constant | "
        "AccumModel saves memory from E = | built-in saves memory from E = | "
        "micro_batch_size saves memory from E = |",
        "|---" * 11 + "|",
    ]
    for f in fits:
        crossovers = [
            ", ".join(
                f"{e:.1f} (N={n})"
                for n, e in f["crossover_effective_batch"].get(kind, {}).items()
            )
            or "-"
            for kind in ("accum", "builtin", "split")
        ]
        lines.append(
            f"| {f['model']} | {f['optimizer']} | {_mib(f['weight_bytes'])} | "
            f"{_mib(f['gradient_bytes'])} "
            f"({_mib(f.get('sparse_gradient_bytes', 0))}; "
            f"{_mib(f['plain_gradient_bytes'])}) | "
            f"{_mib(f['optimizer_slot_bytes'])} | "
            f"{_mib(f['accumulator_bytes'])} | "
            f"{f['activation_bytes_per_sample'] / MIB:,.1f} | "
            f"{_mib(f['constant_bytes'])} | {crossovers[0]} | "
            f"{crossovers[1]} | {crossovers[2]} |"
        )
    return "\n".join(lines)


def _measured_predicted(row):
    """`peak / prediction (error)` in MiB; `fitted` or `n/a` for the latter."""
    if row is None:
        return "-"
    predicted = row.get("predicted_bytes")
    if predicted is None:
        return f"{_mib(row['peak_bytes'])} / n/a"
    if row.get("fitted", False):
        return f"{_mib(row['peak_bytes'])} / fitted"
    error = (predicted - row["peak_bytes"]) / row["peak_bytes"]
    return f"{_mib(row['peak_bytes'])} / {_mib(predicted)} ({error:+.1%})"


def format_split(rows):
    """Each `split_N` row beside plain_E and accum_N, as a Markdown table.

    Peaks measured / predicted, in MiB, and what the split holds beyond
    `accumulate(N)` at the same micro-batch (measured / predicted).
    """
    lines = [
        "| model | optimizer | E = N x B | plain_E | accum_N at B | "
        "micro_batch_size=B at E | split - accum |",
        "|---" * 7 + "|",
    ]
    by = {(r["model"], r["optimizer"], label(r)): r for r in rows}
    for r in rows:
        if r["run"] != "split":
            continue
        key = (r["model"], r["optimizer"])
        n, micro = r["accum_steps"], r["micro_batch"]
        plain = by.get((*key, "plain_E"))
        suffix = "@baseline" if r.get("baseline") else ""
        accum = by.get((*key, f"accum_{n}{suffix}"))
        difference = "-"
        if accum is not None:
            measured = _mib(r["peak_bytes"] - accum["peak_bytes"])
            both = (r.get("predicted_bytes"), accum.get("predicted_bytes"))
            predicted = "n/a" if None in both else _mib(both[0] - both[1])
            difference = f"{measured} / {predicted}"
        lines.append(
            f"| {r['model']} | {r['optimizer']} | "
            f"{n * micro} = {n} x {micro}{suffix} | "
            f"{_measured_predicted(plain)} | "
            f"{_measured_predicted(accum)} | {_measured_predicted(r)} | "
            f"{difference} |"
        )
    return "\n".join(lines)


def machine_info():
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "keras": importlib.metadata.version("keras"),
        "keras_hub": importlib.metadata.version("keras-hub"),
        "tensorflow": importlib.metadata.version("tensorflow"),
    }


def _run_all(configs, jobs, repeats=1):
    """Every configuration `repeats` times, each repeat in rotated order.

    Returns:
        The rows of `aggregate`: one per configuration.
    """
    configs = [c for r in range(repeats) for c in rotated(configs, r)]
    if jobs <= 1:
        results = []
        for config in configs:
            results.append(peak_memory.run_in_process(measure, config))
            _print_progress(results[-1])
        return aggregate(results)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        results = list(
            pool.map(lambda c: peak_memory.run_in_process(measure, c), configs)
        )
    for r in results:
        _print_progress(r)
    return aggregate(results)


def aggregate(results):
    """One row per configuration: its repeats' median peak and speed.

    `peak_bytes_repeats` keeps every process's peak, sorted. How two
    threads interleave a step's operations moves a process's peak (a few
    MiB on a model of 20 MiB of weights): the median of several processes
    is what rows are compared by.
    """
    groups = {}
    for r in results:
        groups.setdefault((r["model"], r["optimizer"], label(r)), []).append(r)
    rows = []
    for group in groups.values():
        row = dict(group[0])
        peaks = sorted(r["peak_bytes"] for r in group)
        row["peak_bytes_repeats"] = peaks
        row["peak_bytes"] = statistics.median(peaks)
        row["samples_per_second"] = statistics.median(
            r["samples_per_second"] for r in group
        )
        rows.append(row)
    return rows


def _print_progress(r):
    print(
        f"{r['model']} {r['optimizer']} {label(r)} (B={r['micro_batch']}"
        f"{', E=' + str(r['fit_batch']) if r['run'] == 'split' else ''}): "
        f"peak {_mib(r['peak_bytes'])} MiB, "
        f"{r['samples_per_second']:.2f} samples/s",
        flush=True,
    )


def _print_tables(rows, fits):
    print()
    print(format_rows(rows))
    print()
    if any(r["run"] == "split" for r in rows):
        print(format_split(rows))
        print()
    if fits:
        print(format_fits(fits))
        print()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    for name, values, known in (
        ("models", _MODELS.value, MODELS),
        ("optimizers", _OPTIMIZERS.value, OPTIMIZERS),
        ("runs", _RUNS.value, RUNS),
    ):
        if not values or any(v not in known for v in values):
            raise app.UsageError(
                f"`--{name}` must be a list of {known}. "
                f"Received: {name}={values!r}"
            )
    if _REPORT.value:
        rows = []
        for path in _REPORT.value:
            with open(path) as f:
                rows += json.load(f)["rows"]
        _print_tables(rows, memory_model(rows))
        return
    quick = _QUICK.value
    effective = 4 if quick else _EFFECTIVE_BATCH.value
    accum_steps = [2] if quick else _ACCUM_STEPS.value
    if not all(
        str(n).isdigit() and int(n) >= 1 and effective % int(n) == 0
        for n in accum_steps
    ):
        raise app.UsageError(
            "`--accum_steps` must be a list of integers >= 1 that divide "
            f"`--effective_batch` ({effective}). "
            f"Received: accum_steps={accum_steps!r}"
        )
    base = dict(
        sequence_length=8 if quick else _SEQUENCE_LENGTH.value,
        image_size=32 if quick else _IMAGE_SIZE.value,
        windows=_WINDOWS.value,
        jit_compile=_JIT_COMPILE.value,
        device=_DEVICE.value,
        quick=quick,
    )
    configs = configurations(
        _MODELS.value,
        _OPTIMIZERS.value,
        _RUNS.value,
        effective,
        [int(n) for n in accum_steps],
        base,
        _BUILTIN_MODELS.value,
    )
    baseline = _BASELINE.value and os.path.abspath(_BASELINE.value)
    if baseline and not os.path.isdir(os.path.join(baseline, "accum_model")):
        raise app.UsageError(
            "`--baseline` must name a folder holding a copy of the package "
            f"(`accum_model/`). Received: baseline={_BASELINE.value!r}"
        )
    configs = with_baseline(configs, baseline)
    started = time.perf_counter()
    rows = _run_all(configs, _JOBS.value, _REPEATS.value)
    fits = memory_model(rows)
    seconds = time.perf_counter() - started
    info = machine_info()
    _print_tables(rows, fits)
    print(
        f"E={effective}, sequence length {base['sequence_length']}, images "
        f"{base['image_size']}px; jit_compile={base['jit_compile']}; the "
        f"largest peak of {base['windows']} "
        f"measured window(s) after one warm-up window, and samples/s over "
        f"them; {rows[0]['device_name']} "
        f"({info['cpu_count']} CPU cores), TensorFlow {info['tensorflow']}, "
        f"Keras {info['keras']}, keras-hub {info['keras_hub']}; "
        f"{len(rows)} processes, {seconds:.0f} s."
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(
                {"machine": info, "rows": rows, "memory_model": fits},
                f,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    app.run(main)
