"""Fine-tune a keras-hub causal LM with gradient accumulation, four ways.

A GPT-2 task (`keras_hub.models.GPT2CausalLM`) with its own preprocessor,
fed raw text of varied lengths that it pads to `sequence_length`. The config
is a tiny preset-like one made in code (vocabulary and merges included), so
nothing is downloaded; with a real preset the one line is the same:

    lm = keras_hub.models.GPT2CausalLM.from_preset("gpt2_base_en")
    accum_model.accumulate(lm, accum_steps=8)

The loss is per valid token (`reduction="mean_with_sample_weight"`: padding
does not count), so micro-batches of short texts weigh less in the large
batch's gradient. From the same weights and with the same AdamW:

  plain B        `fit` at the micro-batch size (more, noisier updates)
  accumulate     `accum_model.accumulate(lm, N)`, `fit` at B
  plain N*B      `fit` at the large batch: the ground truth
  keras builtin  `AdamW(gradient_accumulation_steps=N)`, `fit` at B: the
                 mean of micro-batch gradients, and windows that run on
                 across epoch ends

    python examples/finetune_keras_hub.py --batch_size=4 --accum_steps=4
"""

from absl import app
from absl import flags

_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4, "Micro-batch size B.")
_ACCUM_STEPS = flags.DEFINE_integer(
    "accum_steps", 4, "Micro-batches per update N."
)
_TEXTS = flags.DEFINE_integer("texts", 72, "Number of training texts.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Epochs.")
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 16, "Tokens the preprocessor pads or cuts to."
)
_HIDDEN = flags.DEFINE_integer("hidden_dim", 16, "Width of the model.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer layers.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "AdamW rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the data and the weights.")

_LETTERS = "abcdefgh"
_PROMPT = "a b"


def make_texts(count, max_words, seed):
    """Texts of 1 to `max_words` one-letter words, bucketed by length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, max_words + 1, size=count))
    return [" ".join(rng.choice(list(_LETTERS), size=n)) for n in lengths]


def build(seed):
    """A tiny GPT-2 task, as `from_preset` would give, made in code."""
    import keras
    import keras_hub

    models = keras_hub.models
    # Byte-pair vocabulary: "Ġ" marks a space before a word.
    vocabulary = {"<|endoftext|>": 0, "Ġ": 1}
    for letter in _LETTERS:
        vocabulary[letter] = len(vocabulary)
        vocabulary["Ġ" + letter] = len(vocabulary)
    merges = ["Ġ " + letter for letter in _LETTERS]
    keras.utils.set_random_seed(seed)
    backbone = models.GPT2Backbone(
        vocabulary_size=len(vocabulary),
        num_layers=_LAYERS.value,
        num_heads=2,
        hidden_dim=_HIDDEN.value,
        intermediate_dim=2 * _HIDDEN.value,
        dropout=0.0,
        max_sequence_length=_SEQUENCE_LENGTH.value,
    )
    preprocessor = models.GPT2CausalLMPreprocessor(
        models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges),
        sequence_length=_SEQUENCE_LENGTH.value,
    )
    return models.GPT2CausalLM(backbone, preprocessor=preprocessor)


def main(argv):
    del argv
    import time

    import keras
    import numpy as np

    import accum_model

    micro, steps = _BATCH_SIZE.value, _ACCUM_STEPS.value
    texts = make_texts(_TEXTS.value, _SEQUENCE_LENGTH.value // 2, _SEED.value)
    initial = build(_SEED.value).get_weights()

    def run(batch_size, accum_steps=None, builtin=False):
        lm = build(_SEED.value)
        lm.set_weights(initial)
        if accum_steps:
            accum_model.accumulate(lm, accum_steps)
        # The task's own default compile, but for the optimizer and a loss
        # per valid token.
        lm.compile(
            optimizer=keras.optimizers.AdamW(
                _LEARNING_RATE.value,
                weight_decay=0.01,
                gradient_accumulation_steps=steps if builtin else None,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
        )
        lm.fit(texts, batch_size=batch_size, epochs=_EPOCHS.value, verbose=0)
        # Applied updates (Keras' built-in option counts its windows).
        updates = int(lm.optimizer.iterations)
        loss = lm.evaluate(texts, batch_size=len(texts), verbose=0)
        loss = loss[0] if isinstance(loss, list) else loss
        generated = None
        if accum_steps:
            # Its own `generate` still works on the accumulating task.
            generated = lm.generate(
                [_PROMPT], max_length=_SEQUENCE_LENGTH.value
            )[0]
        return lm.get_weights(), updates, loss, generated

    start = time.time()
    runs = {
        f"plain (B={micro})": run(micro),
        f"accumulate (B={micro}, N={steps})": run(micro, steps),
        f"plain (B={micro * steps})": run(micro * steps),
        f"keras builtin (B={micro}, N={steps})": run(micro, builtin=True),
    }
    large = runs[f"plain (B={micro * steps})"][0]
    print(
        f"GPT2CausalLM, {len(texts)} texts of 1-{_SEQUENCE_LENGTH.value // 2}"
        f" words padded to {_SEQUENCE_LENGTH.value} tokens, "
        f"{_EPOCHS.value} epochs, AdamW, loss per valid token\n"
    )
    print(
        f"{'method':<30}{'updates':>8}{'final loss':>12}"
        f"{'max |w - w_large|':>20}"
    )
    diffs = {}
    for name, (weights, updates, loss, _) in runs.items():
        diffs[name] = max(
            float(np.max(np.abs(w - w_large)))
            for w, w_large in zip(weights, large)
        )
        print(f"{name:<30}{updates:>8}{loss:>12.4f}{diffs[name]:>20.2e}")
    sample = runs[f"accumulate (B={micro}, N={steps})"][3]
    print(f"\naccumulate, then generate({_PROMPT!r}): {sample!r}")
    accumulated = diffs[f"accumulate (B={micro}, N={steps})"]
    if accumulated < 1e-4:
        print(
            "accumulate matches the large batch "
            f"(max |w - w_large| = {accumulated:.1e})"
        )
    else:
        print(f"accumulate DIFFERS from the large batch ({accumulated:.1e})")
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    app.run(main)
