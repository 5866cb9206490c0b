"""What the first `fit` costs: tracing, and compiling the window's update.

`AccumModel` compiles the window's update (the optimizer's apply of the
accumulated mean) with XLA where the step is not compiled whole (Keras'
default on a CPU; docs/semantics.md): a one-off cost at the first window,
against a faster update at every window after it. For each model and
configuration, each run in a fresh process (a compilation is cached per
process), repeated `--repeats` times in an order rotated each repeat:

  plain        plain `keras.Model.fit` at micro-batch B (Keras' own first
               step: its trace)
  accum        `accumulate(model, N)` at B, the update compiled apart
  accum_nojit  the same with `compile(jit_compile=False)`: the update as
               Keras runs it, nothing compiled

each run training 1 + `--windows` windows of N batches: the first window's
seconds (trace, compilation, run), the median of the others (steady), and
the first's excess over a steady window. From the medians over the
repeats: the compiled update's one-off cost (accum's excess beyond
accum_nojit's), what it saves per update (accum_nojit's steady window
beyond accum's), and the updates it takes to pay for itself.

Models: GPT-2 124M (keras-hub's `GPT2CausalLM` at the base configuration,
random weights, nothing downloaded) and the 5.3M-parameter MLP of
bench_memory.py; AdamW.

    python benchmarks/bench_first_fit.py                     # both models
    python benchmarks/bench_first_fit.py --models=mlp --repeats=5
    python benchmarks/bench_first_fit.py --quick             # smoke run
"""

import json
import os
import statistics
import sys
import time

from absl import app
from absl import flags

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_ROOT, _HERE, os.path.join(_ROOT, "examples")]
import peak_memory  # noqa: E402
from repeats import median_interval  # noqa: E402
from repeats import rotated  # noqa: E402

MODELS = ("gpt2", "mlp")
CONFIGS = ("plain", "accum", "accum_nojit")

_MODELS = flags.DEFINE_list("models", list(MODELS), f"Which of {MODELS}.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Processes per model and configuration, interleaved."
)
_ACCUM_STEPS = flags.DEFINE_integer("accum_steps", 2, "N.")
_WINDOWS = flags.DEFINE_integer(
    "windows", 3, "Steady windows timed after the first."
)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 128, "Tokens per sample (GPT-2)."
)
_QUICK = flags.DEFINE_bool(
    "quick", False, "Tiny models: checks the program, measures nothing."
)
_JSON = flags.DEFINE_string("json", None, "Also write the results here.")

# Micro-batch B per model: GPT-2's update dominates at 1 sample of 128
# tokens, as in fine-tuning at the batch that fits.
MICRO_BATCH = {"gpt2": 1, "mlp": 32}


def _build(name, quick, samples, length):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "gpt2":
        import keras_hub

        arch = dict(
            vocabulary_size=1000 if quick else 50257,
            num_layers=2 if quick else 12,
            num_heads=2 if quick else 12,
            hidden_dim=32 if quick else 768,
            intermediate_dim=64 if quick else 3072,
        )
        backbone = keras_hub.models.GPT2Backbone(
            max_sequence_length=max(length, 16 if quick else 1024), **arch
        )
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        vocabulary = arch["vocabulary_size"]
        x = {
            "token_ids": rng.integers(0, vocabulary, (samples, length)).astype(
                "int32"
            ),
            "padding_mask": np.ones((samples, length), "int32"),
        }
        y = rng.integers(0, vocabulary, (samples, length)).astype("int32")
        return model, x, y
    import keras

    width = 64 if quick else 1024
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(5):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    x = rng.normal(size=(samples, width)).astype("float32")
    y = rng.integers(0, 10, (samples,)).astype("int32")
    return model, x, y


def measure(config, queue):
    """Trains one configuration in this process; puts its timings."""
    peak_memory.prepare_process("cpu")
    import keras
    import tensorflow as tf

    import accum_model

    tf.get_logger().setLevel("ERROR")
    n, micro = config["accum_steps"], config["micro_batch"]
    windows = 1 + config["windows"]
    keras.utils.set_random_seed(0)
    model, x, y = _build(
        config["model"],
        config["quick"],
        micro * n * windows,
        config["sequence_length"],
    )
    compile_kwargs = {}
    if config["config"] != "plain":
        accum_model.accumulate(model, n)
    if config["config"] == "accum_nojit":
        compile_kwargs["jit_compile"] = False
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )

    class Clock(keras.callbacks.Callback):
        """The wall time of each window of N batches, from the first one's
        start; a variable read waits for the window's last step."""

        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            if batch % n == 0:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch % n == n - 1:
                int(model.optimizer.iterations.numpy())
                self.seconds.append(time.perf_counter() - self.start)

    clock = Clock()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
    first, *steady = clock.seconds
    queue.put(
        {
            **config,
            "first_window_seconds": first,
            "steady_window_seconds": statistics.median(steady),
            "updates": int(model.optimizer.iterations.numpy()),
            "parameters": int(model.count_params()),
        }
    )


def summarize(rows):
    """Per model: medians and intervals over the repeats, and the verdict.

    Returns:
        A dict per model: for each configuration the median [interval] of
        its first window, steady window and excess, and `compile_seconds`,
        `saved_seconds_per_update`, `break_even_updates` from the medians.
    """
    out = {}
    for model in sorted({r["model"] for r in rows}):
        entry = {}
        for config in CONFIGS:
            rs = [
                r for r in rows if r["model"] == model and r["config"] == config
            ]
            if not rs:
                continue
            stats = {}
            for key, values in (
                ("first", [r["first_window_seconds"] for r in rs]),
                ("steady", [r["steady_window_seconds"] for r in rs]),
                (
                    "excess",
                    [
                        r["first_window_seconds"] - r["steady_window_seconds"]
                        for r in rs
                    ],
                ),
            ):
                low, high, _ = median_interval(values)
                stats[key] = (statistics.median(values), low, high)
            entry[config] = stats
        if "accum" in entry and "accum_nojit" in entry:
            n = rows[0]["accum_steps"]
            compile_cost = (
                entry["accum"]["excess"][0] - entry["accum_nojit"]["excess"][0]
            )
            # A steady window holds one update.
            saved = (
                entry["accum_nojit"]["steady"][0] - entry["accum"]["steady"][0]
            )
            entry["compile_seconds"] = compile_cost
            entry["saved_seconds_per_update"] = saved
            entry["break_even_updates"] = (
                compile_cost / saved if saved > 0 else float("inf")
            )
            entry["accum_steps"] = n
        out[model] = entry
    return out


def format_table(summary):
    lines = [
        "| model | run | first window s | steady window s | first - steady s |",
        "|---|---|---|---|---|",
    ]
    for model, entry in summary.items():
        for config in CONFIGS:
            if config not in entry:
                continue
            cells = [
                f"{m:.3f} [{lo:.3f}-{hi:.3f}]"
                for m, lo, hi in (
                    entry[config]["first"],
                    entry[config]["steady"],
                    entry[config]["excess"],
                )
            ]
            lines.append(f"| {model} | {config} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "| model | update compiled: one-off s | saved per update s | "
        "updates to pay for it |"
    )
    lines.append("|---|---|---|---|")
    for model, entry in summary.items():
        if "compile_seconds" in entry:
            lines.append(
                f"| {model} | {entry['compile_seconds']:.2f} | "
                f"{entry['saved_seconds_per_update']:.3f} | "
                f"{entry['break_even_updates']:.0f} |"
            )
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    if not _MODELS.value or any(m not in MODELS for m in _MODELS.value):
        raise app.UsageError(
            f"`--models` must be a list of {MODELS}. "
            f"Received: models={_MODELS.value!r}"
        )
    if _REPEATS.value < 1 or _ACCUM_STEPS.value < 1 or _WINDOWS.value < 1:
        raise app.UsageError(
            "`--repeats`, `--accum_steps` and `--windows` must be >= 1. "
            f"Received: repeats={_REPEATS.value}, "
            f"accum_steps={_ACCUM_STEPS.value}, windows={_WINDOWS.value}"
        )
    quick = _QUICK.value
    started = time.perf_counter()
    rows = []
    for r in range(_REPEATS.value):
        for model in _MODELS.value:
            for config in rotated(CONFIGS, r):
                result = peak_memory.run_in_process(
                    measure,
                    dict(
                        model=model,
                        config=config,
                        accum_steps=_ACCUM_STEPS.value,
                        micro_batch=2 if quick else MICRO_BATCH[model],
                        windows=_WINDOWS.value,
                        sequence_length=8 if quick else _SEQUENCE_LENGTH.value,
                        quick=quick,
                    ),
                )
                rows.append(result)
                print(
                    f"{model} {config} (repeat {r + 1}): first window "
                    f"{result['first_window_seconds']:.2f} s, steady "
                    f"{result['steady_window_seconds']:.3f} s",
                    flush=True,
                )
    summary = summarize(rows)
    print()
    print(format_table(summary))
    print(
        f"\nN={_ACCUM_STEPS.value}, {_REPEATS.value} repeat(s), medians "
        f"[interval]; {time.perf_counter() - started:.0f} s."
    )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
