"""Padded sequences: exact per-token normalization against naive averaging.

A sequence tagger (`Embedding(mask_zero=True)` + GRU + Dense) on padded
token ids. Keras divides a masked loss by the number of *valid* tokens of the
batch, so the large batch's gradient weights each micro-batch by its valid
tokens. Averaging micro-batch gradients by sample count instead (what Keras'
built-in `gradient_accumulation_steps` and most accumulation recipes do)
over-weights micro-batches of short sequences: the gradient-accumulation loss
bug of sequence-model training.

The sequences are bucketed by length, as is common, so micro-batches hold
very different numbers of valid tokens. From the same weights, one update of
plain SGD with learning rate 1 is taken three or four ways, and the update
(= the gradient) compared with the large batch's:

  exact     `AccumModel`, default normalizer (valid tokens per micro-batch)
  naive     `AccumModel` whose `compute_loss_normalizer` returns the sample
            count
  builtin   Keras' `SGD(gradient_accumulation_steps=N)` (Keras 3 only)

    python examples/padded_sequences.py --batch_size=8 --accum_steps=4
"""

from absl import app
from absl import flags

_ACCUM_STEPS = flags.DEFINE_integer(
    "accum_steps", 4, "Micro-batches per optimizer update."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Micro-batch size.")
_MAX_LEN = flags.DEFINE_integer("max_len", 40, "Padded sequence length.")
_VOCAB = flags.DEFINE_integer("vocab", 50, "Vocabulary size (0 is padding).")
_UNITS = flags.DEFINE_integer("units", 16, "GRU and embedding width.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

_CLASSES = 5


def make_data(samples, max_len, vocab, seed):
    """Token ids padded with 0, sorted by length (bucketed), and tags."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, max_len + 1, size=samples))[::-1]
    x = np.zeros((samples, max_len), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, vocab, size=length)
    y = rng.integers(0, _CLASSES, size=(samples, max_len)).astype("int32")
    return x, y


def build(cls, vocab, max_len, units, seed, **kwargs):
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((max_len,), dtype="int32")
    h = keras.layers.Embedding(vocab, units, mask_zero=True)(inputs)
    h = keras.layers.GRU(units, return_sequences=True)(h)
    outputs = keras.layers.Dense(_CLASSES)(h)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def one_update(model, x, y, batch_size, optimizer):
    """The gradient of one update: the weights' change under SGD(lr=1)."""
    import numpy as np
    import tensorflow as tf

    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    after = model.get_weights()
    return np.concatenate([(b - a).ravel() for b, a in zip(before, after)])


def main(argv):
    del argv
    import numpy as np
    import tensorflow as tf

    from accum_model import AccumModel

    # Keras 3's optimizers have `gradient_accumulation_steps`; tf_keras'
    # (TF_USE_LEGACY_KERAS=1) do not.
    builtin = not tf.keras.Model.__module__.startswith("tf_keras")

    class NaiveAccumModel(AccumModel):
        """Weights each micro-batch by its sample count (the bug)."""

        def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
            return tf.cast(tf.shape(x)[0], tf.float32)

    micro, steps = _BATCH_SIZE.value, _ACCUM_STEPS.value
    x, y = make_data(micro * steps, _MAX_LEN.value, _VOCAB.value, _SEED.value)
    args = (_VOCAB.value, _MAX_LEN.value, _UNITS.value, _SEED.value)

    large = one_update(
        build(tf.keras.Model, *args),
        x,
        y,
        micro * steps,
        tf.keras.optimizers.SGD(1.0),
    )
    runs = [
        (
            "exact (valid tokens)",
            build(AccumModel, *args, accum_steps=steps),
            tf.keras.optimizers.SGD(1.0),
        ),
        (
            "naive (sample count)",
            build(NaiveAccumModel, *args, accum_steps=steps),
            tf.keras.optimizers.SGD(1.0),
        ),
    ]
    if builtin:
        runs.append(
            (
                "Keras built-in",
                build(tf.keras.Model, *args),
                tf.keras.optimizers.SGD(1.0, gradient_accumulation_steps=steps),
            )
        )

    tokens = (x != 0).reshape(steps, micro, -1).sum(axis=(1, 2))
    print(
        f"{steps} micro-batches of {micro} sequences (length "
        f"{_MAX_LEN.value}); valid tokens per micro-batch: "
        f"{tokens.tolist()}"
    )
    print(
        f"{'normalization':<24}{'max |g - g_large|':>20}"
        f"{'|g - g_large| / |g_large|':>28}"
    )
    errors = {}
    for name, model, optimizer in runs:
        grad = one_update(model, x, y, micro, optimizer)
        diff = grad - large
        rel = float(np.linalg.norm(diff) / np.linalg.norm(large))
        errors[name] = rel
        print(f"{name:<24}{np.max(np.abs(diff)):>20.2e}{rel:>28.2e}")
    exact, naive = (
        errors["exact (valid tokens)"],
        errors["naive (sample count)"],
    )
    print(
        f"\nexact normalization matches the large batch (relative error "
        f"{exact:.1e}); naive averaging is off by {naive:.1e}."
    )


if __name__ == "__main__":
    app.run(main)
