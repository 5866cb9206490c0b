"""keras-hub tasks made to accumulate, against the same task at the large batch.

Tiny tasks built in code (vocabularies and merges too), fed raw strings
through their own preprocessors: nothing is downloaded.
"""

import os
import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import accum_model
from accum_model import AccumModel
from accum_model import accumulate
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

try:
    import keras_hub
except ImportError:  # Skipped below, with the reason.
    keras_hub = None

_TINY = dict(
    num_layers=1,
    num_heads=2,
    hidden_dim=8,
    intermediate_dim=16,
    max_sequence_length=8,
    dropout=0.0,
)
_BERT_VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "the",
    "quick",
    "fox",
    "jumps",
]
_TEXTS = [
    "the quick fox",
    "fox",
    "the the jumps",
    "quick fox the",
    "fox fox",
    "the",
    "jumps quick",
    "fox quick the jumps",
    "quick",
    "the fox",
]
_LABELS = np.array([0, 1, 0, 1, 1, 0, 1, 0, 1, 0])
# GPT-2's byte-pair vocabulary: "Ġ" (a space) before a word, merged.
_GPT2_VOCAB = {
    "<|endoftext|>": 0,
    "a": 1,
    "b": 2,
    "c": 3,
    "Ġ": 4,
    "Ġa": 5,
    "Ġb": 6,
    "Ġc": 7,
}
_GPT2_MERGES = ["Ġ a", "Ġ b", "Ġ c"]
# Different lengths: the preprocessor pads to `sequence_length`.
_LM_TEXTS = ["a b c", "b", "c a a b", "a", "b b a c a", "c c", "a b"]


class _DenseGradients:
    """An optimizer mixin applying `tf.IndexedSlices` gradients densified.

    For the ground truth: Keras' sparse Adam update squares the repeated
    rows of an embedding's gradient one by one (BERT's `[CLS]` row, its
    segment row), which is not Adam on the large batch's gradient;
    accumulation sums them first, as the large batch's gradient does.
    """

    def apply(self, grads, trainable_variables=None):
        grads = [
            tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in grads
        ]
        return super().apply(grads, trainable_variables)


def _optimizer(name, dense=False):
    cls = {"momentum": keras.optimizers.SGD, "adamw": keras.optimizers.AdamW}[
        name
    ]
    if dense:
        cls = type("Dense" + cls.__name__, (_DenseGradients, cls), {})
    if name == "momentum":
        return cls(0.05, momentum=0.9)
    return cls(0.01, weight_decay=0.1)


def _bert(cls=None, seed=0, **kwargs):
    models = keras_hub.models
    keras.utils.set_random_seed(seed)
    cls = cls or models.BertTextClassifier
    return cls(
        models.BertBackbone(vocabulary_size=len(_BERT_VOCAB), **_TINY),
        num_classes=2,
        dropout=0.0,
        preprocessor=models.BertTextClassifierPreprocessor(
            models.BertTokenizer(vocabulary=_BERT_VOCAB), sequence_length=8
        ),
        **kwargs,
    )


def _gpt2(seed=0):
    models = keras_hub.models
    keras.utils.set_random_seed(seed)
    tokenizer = models.GPT2Tokenizer(
        vocabulary=_GPT2_VOCAB, merges=_GPT2_MERGES
    )
    return models.GPT2CausalLM(
        models.GPT2Backbone(vocabulary_size=len(_GPT2_VOCAB), **_TINY),
        preprocessor=models.GPT2CausalLMPreprocessor(
            tokenizer, sequence_length=8
        ),
    )


def _fit(
    task, batch_size, optimizer, epochs=2, y=None, loss="auto", **fit_kwargs
):
    """Compiles `task` with its own defaults but `optimizer`, and fits it.

    A plain task (the ground truth) applies its gradients densified.
    """
    dense = not isinstance(task, AccumModel)
    task.compile(optimizer=_optimizer(optimizer, dense), loss=loss)
    recorder = tu.UpdateRecorder()
    x = _LM_TEXTS if y is None else _TEXTS
    task.fit(
        x=x,
        y=y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        callbacks=[recorder],
        **fit_kwargs,
    )
    return recorder.weights


@tu.skip_unless_available("keras_hub")
class BertTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("momentum", "momentum"), ("adamw", "adamw")
    )
    def test_equals_same_task_at_large_batch(self, optimizer):
        reference = _bert()
        task = tu.copy_weights(reference, _bert(seed=1))
        self.assertIs(accumulate(task, 2), task)
        self.assertIsInstance(task, keras_hub.models.BertTextClassifier)
        self.assertIsInstance(task, AccumModel)
        self.assertIsNotNone(task.preprocessor)
        expected = _fit(reference, 4, optimizer, y=_LABELS)
        actual = _fit(task, 2, optimizer, y=_LABELS)
        self.assertLen(actual, 6)  # 10 texts: windows of 4, 4, 2 per epoch
        tu.assert_same_trajectory(self, expected, actual)
        # Raw strings in, through its own preprocessor.
        self.assertEqual(task.predict(_TEXTS[:3], verbose=0).shape, (3, 2))

    def test_default_compile_kept(self):
        # Compiled by the task's own `__init__`; `accumulate` keeps it.
        task = accumulate(_bert(), 2)
        self.assertTrue(task.compiled)
        self.assertIsInstance(task.optimizer, keras.optimizers.Adam)
        task.fit(_TEXTS, _LABELS, batch_size=2, verbose=0)
        self.assertEqual(int(task.optimizer.iterations), 3)

    def test_keras_file_keeps_accumulating(self):
        task = accumulate(_bert(), 2, epoch_end="carry")
        path = os.path.join(self.get_temp_dir(), "bert.keras")
        task.save(path)
        with warnings.catch_warnings():
            # The task's own `compile` makes Keras skip the saved one.
            warnings.simplefilter("ignore")
            restored = keras.models.load_model(path)
        self.assertIs(type(restored), type(task))
        self.assertEqual(
            (restored.accum_steps, restored.epoch_end), (2, "carry")
        )
        self.assertIsNotNone(restored.preprocessor)
        reference = tu.copy_weights(restored, _bert(seed=3))
        expected = _fit(reference, 4, "momentum", y=_LABELS, epochs=1)
        actual = _fit(restored, 2, "momentum", y=_LABELS, epochs=1)
        tu.assert_same_trajectory(self, expected[:2], actual)

    def test_save_plain_loads_without_accum_model(self):
        # An inference service with keras-hub but not accum_model.
        task = accumulate(_bert(), 2, epoch_end="carry")
        _fit(task, 2, "momentum", y=_LABELS, epochs=1)
        path = os.path.join(self.get_temp_dir(), "plain.keras")
        accum_model.save_plain(task, path)
        loaded = tu.load_without_accum_model([path], _TEXTS[:3])[path]
        self.assertEqual(loaded[0], "BertTextClassifier")
        self.assertAllClose(
            loaded[1], task.predict(_TEXTS[:3], verbose=0), atol=1e-5
        )

    def test_clone_model_warns_and_accumulates(self):
        task = accumulate(_bert(), 3)
        with self.assertWarnsRegex(UserWarning, "plain Functional"):
            clone = keras.models.clone_model(task)
        self.assertIsInstance(clone, AccumModel)
        self.assertEqual(clone.accum_steps, 3)

    @parameterized.named_parameters(
        ("accum_first", True), ("accum_second", False)
    )
    def test_subclass_in_either_order(self, accum_first):
        bert_cls = keras_hub.models.BertTextClassifier
        bases = (
            (AccumModel, bert_cls) if accum_first else (bert_cls, AccumModel)
        )
        cls = type("AccumBert", bases, {})
        sw = np.linspace(0.5, 2.0, len(_TEXTS)).astype("float32")
        reference = _bert()
        task = tu.copy_weights(reference, _bert(cls, accum_steps=2))
        self.assertEqual(task.accum_steps, 2)
        recorders = []
        for model, batch in ((reference, 4), (task, 2)):
            model.compile(optimizer=_optimizer("momentum"))
            recorders.append(tu.UpdateRecorder())
            # keras-hub's `fit` takes `sample_weight` fourth.
            model.fit(
                _TEXTS,
                _LABELS,
                batch,
                sw,
                epochs=1,
                verbose=0,
                callbacks=[recorders[-1]],
            )
        tu.assert_same_trajectory(
            self, recorders[0].weights, recorders[1].weights
        )
        path = os.path.join(self.get_temp_dir(), "sub.keras")
        task.save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = keras.models.load_model(
                path, custom_objects={"AccumBert": cls}
            )
        self.assertIsInstance(restored, cls)
        self.assertEqual(restored.accum_steps, 2)

    def test_lora_accumulates_only_lora_weights(self):
        reference, task = _bert(), _bert(seed=1)
        for model in (reference, task):
            model.backbone.enable_lora(2)
        tu.copy_weights(reference, task)
        accumulate(task, 2)
        expected = _fit(reference, 4, "adamw", y=_LABELS, epochs=1)
        actual = _fit(task, 2, "adamw", y=_LABELS, epochs=1)
        tu.assert_same_trajectory(self, expected, actual)
        trainable = task.trainable_variables
        self.assertLess(len(trainable), len(task.weights) // 2)
        engine = task.gradient_accumulator
        # The window holds one float32 sum per trainable variable (besides
        # counters and a flag per variable): as many bytes as the trainable
        # weights.
        window = engine._engine.accumulators
        nbytes = lambda vs: sum(  # noqa: E731
            int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in vs
        )
        self.assertEqual(nbytes(window), nbytes(trainable))
        self.assertEqual(
            [tuple(v.shape) for v in window],
            [tuple(v.shape) for v in trainable],
        )


@tu.skip_unless_available("keras_hub")
class GPT2Test(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("adamw", "adamw", "auto"),
        # Per valid token rather than over B*T with padding; momentum.
        ("per_token_loss", "momentum", "per_token"),
    )
    def test_equals_same_task_at_large_batch(self, optimizer, loss):
        if loss == "per_token":
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            )
        reference = _gpt2()
        lm = tu.copy_weights(reference, _gpt2(seed=1))
        accumulate(lm, 2)
        # 7 texts at 2: windows of 4, 3 samples (a short last micro-batch).
        expected = _fit(reference, 4, optimizer, loss=loss)
        actual = _fit(lm, 2, optimizer, loss=loss)
        self.assertLen(actual, 4)
        tu.assert_same_trajectory(self, expected, actual)

    def test_micro_batch_size_equals_the_batch(self):
        # Each batch of 4 texts split into slices of 2 (and the short last
        # batch of 3 into 2 + 1), per valid token.
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
        reference = _gpt2()
        lm = tu.copy_weights(reference, _gpt2(seed=1))
        accumulate(lm, micro_batch_size=2)
        expected = _fit(reference, 4, "momentum", loss=loss)
        actual = _fit(lm, 4, "momentum", loss=loss)
        self.assertLen(actual, 4)
        tu.assert_same_trajectory(self, expected, actual)

    def test_generate_after_training_and_file(self):
        lm = accumulate(_gpt2(), 2)
        _fit(lm, 2, "adamw", epochs=1)
        out = lm.generate(["a b"], max_length=6)
        self.assertLen(out, 1)
        self.assertIsInstance(out[0], str)
        self.assertStartsWith(out[0], "a b")
        path = os.path.join(self.get_temp_dir(), "lm.keras")
        lm.save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = keras.models.load_model(path)
        self.assertIsInstance(restored, keras_hub.models.GPT2CausalLM)
        self.assertEqual(restored.accum_steps, 2)
        tu.assert_same_trajectory(
            self, [lm.get_weights()], [restored.get_weights()], atol=0
        )
        # 7 texts at 2: 4 micro-batches, 2 updates of 2.
        _fit(restored, 2, "momentum", epochs=1)
        self.assertEqual(int(restored.optimizer.iterations), 2)


if __name__ == "__main__":
    tf.test.main()
