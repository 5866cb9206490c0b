"""Exact loss normalization: masked, sample-weighted and multi-output losses.

Each micro-batch's gradient must enter the window weighted by what its loss
divided by. The reference is plain large-batch Keras training from the same
weights; each exactness test also checks that naive averaging by sample count
is off by far more, so it proves the test discriminates.
"""

import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_VOCAB, _T, _CLASSES = 7, 6, 3


class NaiveAccumModel(AccumModel):
    """Weights every micro-batch by its sample count, whatever the loss did."""

    def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
        return tf.cast(tf.shape(x)[0], tf.float32)


def padded_sequences(n, micro, seed=0):
    """Token ids padded with 0; valid lengths alternate 6 and 1 per micro-batch.

    So the valid-token counts of consecutive micro-batches differ 6 to 1.
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(1, _VOCAB, size=(n, _T)).astype("int32")
    y = rng.integers(0, _CLASSES, size=(n, _T)).astype("int32")
    for i in range(n):
        length = _T if (i // micro) % 2 == 0 else 1
        x[i, length:] = 0
    return x, y


def sequence_model(cls, seed=0, rnn=True, **kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((_T,), dtype="int32")
    h = keras.layers.Embedding(_VOCAB, 4, mask_zero=True)(inputs)
    if rnn:
        h = keras.layers.SimpleRNN(4, return_sequences=True)(h)
    else:
        h = keras.layers.Dense(4, activation="tanh")(h)
    outputs = keras.layers.Dense(_CLASSES)(h)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


def _ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _three_runs(build, x, y, micro, steps, loss, epochs=1, **fit_kwargs):
    """Per-update weights of large batch, exact accumulation, naive."""
    reference = build(keras.Model)
    exact = tu.copy_weights(reference, build(AccumModel, accum_steps=steps))
    naive = tu.copy_weights(
        reference, build(NaiveAccumModel, accum_steps=steps)
    )
    _, expected = tu.train(
        reference, x, y, micro * steps, epochs, "sgd", loss, **fit_kwargs
    )
    _, got_exact = tu.train(
        exact, x, y, micro, epochs, "sgd", loss, **fit_kwargs
    )
    _, got_naive = tu.train(
        naive, x, y, micro, epochs, "sgd", loss, **fit_kwargs
    )
    return expected, got_exact, got_naive


def bucket_model(cls, seed=0, **kwargs):
    """Per-token logits for sequences of any length, without a mask."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(_VOCAB, 4)(inputs)
    h = keras.layers.Dense(4, activation="tanh")(h)
    outputs = keras.layers.Dense(_CLASSES)(h)
    return cls(inputs=inputs, outputs=outputs, **kwargs)


# (samples, length) of each micro-batch: two windows of 2, whose token
# counts differ 24 to 8 and 10 to 12 (sample counts 4:4 and 2:4).
_BUCKETS = [(4, 6), (4, 2), (2, 5), (4, 3)]


def _buckets(sample_weight_shape=None, seed=3):
    rng = np.random.default_rng(seed)
    batches = []
    for samples, length in _BUCKETS:
        x = rng.integers(0, _VOCAB, size=(samples, length)).astype("int32")
        y = rng.integers(0, _CLASSES, size=(samples, length)).astype("int32")
        batch = [x, y]
        if sample_weight_shape == "token":
            batch.append(rng.uniform(0.1, 2.0, (samples, length)))
        elif sample_weight_shape == "sample":
            batch.append(rng.uniform(0.1, 2.0, (samples, 1)))
        batches.append(
            tuple(
                np.asarray(b, b.dtype if b.dtype != np.float64 else "float32")
                for b in batch
            )
        )
    return batches


def _bucket_dataset(batches):
    dataset = tf.data.Dataset.from_tensors(batches[0])
    for batch in batches[1:]:
        dataset = dataset.concatenate(tf.data.Dataset.from_tensors(batch))
    return dataset


class PerSequenceCrossentropy(keras.losses.Loss):
    """One value per sequence: its mean token loss (reduces two axes)."""

    def call(self, y_true, y_pred):
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(
                y_true, y_pred, from_logits=True
            ),
            axis=-1,
        )


def _bucket_windows_by_hand(model, batches, steps, lr, per_sequence=False):
    """SGD on each window's mean over its loss elements: the sum of
    per-token losses (times their sample weights) over the number of tokens
    in the window, or with `per_sequence` the sum of the sequences' mean
    token losses over the number of sequences."""
    trajectory = []
    for start in range(0, len(batches), steps):
        window = batches[start : start + steps]
        with tf.GradientTape() as tape:
            total, tokens = 0.0, 0
            for batch in window:
                per_token = keras.losses.sparse_categorical_crossentropy(
                    batch[1], model(batch[0]), from_logits=True
                )
                if per_sequence:
                    per_token = tf.reduce_mean(per_token, axis=-1)
                if len(batch) == 3:
                    per_token = per_token * batch[2]
                total += tf.reduce_sum(per_token)
                tokens += int(tf.size(per_token))
            loss = total / tokens
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(lr * tf.convert_to_tensor(g))
        trajectory.append([np.array(w) for w in model.get_weights()])
    return trajectory


class SequenceBucketTest(tf.test.TestCase, parameterized.TestCase):
    """Per-token losses over buckets of different lengths, no padding.

    No plain large batch exists (the lengths differ), so the reference is
    the window's token-level mean, differentiated by hand.
    """

    @parameterized.named_parameters(
        ("no_weights", None, "sum_over_batch_size"),
        ("per_token_weights", "token", "sum_over_batch_size"),
        ("per_sample_weights", "sample", "sum_over_batch_size"),
        ("mean_with_sample_weight_unweighted", None, "mean_with_sample_weight"),
    )
    def test_window_is_the_token_level_mean(self, weights, reduction):
        if reduction == "mean_with_sample_weight" and tu.TF_KERAS:
            self.skipTest("tf_keras has no mean_with_sample_weight reduction")
        lr = 0.5
        batches = _buckets(weights)
        reference = bucket_model(keras.Model)
        expected = _bucket_windows_by_hand(reference, batches, 2, lr)
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction
        )
        trajectories = {}
        for cls in (AccumModel, NaiveAccumModel):
            model = bucket_model(cls, accum_steps=2)
            _, trajectories[cls] = tu.train(
                model,
                _bucket_dataset(batches),
                None,
                None,
                1,
                keras.optimizers.SGD(lr),
                loss,
            )
        tu.assert_same_trajectory(self, expected, trajectories[AccumModel])
        # Weighting by samples (the rule before) is far off.
        self.assertGreater(
            tu.trajectory_diff(expected, trajectories[NaiveAccumModel]), 1e-3
        )

    def test_loss_reducing_the_tokens_itself_counts_sequences(self):
        # The loss returns one value per sequence, so Keras divides by the
        # number of sequences; counting every axis but the last would weight
        # the micro-batches by tokens.
        lr = 0.5
        batches = _buckets()
        expected = _bucket_windows_by_hand(
            bucket_model(keras.Model), batches, 2, lr, per_sequence=True
        )
        model = bucket_model(AccumModel, accum_steps=2)
        _, actual = tu.train(
            model,
            _bucket_dataset(batches),
            None,
            None,
            1,
            keras.optimizers.SGD(lr),
            PerSequenceCrossentropy(),
        )
        tu.assert_same_trajectory(self, expected, actual)


class MaskedLossTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(("rnn", True), ("dense", False))
    def test_padded_sequences_match_large_batch(self, rnn):
        x, y = padded_sequences(16, micro=4)
        expected, exact, naive = _three_runs(
            lambda cls, **kw: sequence_model(cls, rnn=rnn, **kw),
            x,
            y,
            micro=4,
            steps=2,
            loss=_ce(),
            epochs=2,
        )
        tu.assert_same_trajectory(self, expected, exact, atol=1e-5)
        # Sample-count averaging over-weights the short sequences.
        self.assertGreater(tu.trajectory_diff(expected, naive), 1e-3)

    def test_masked_loss_with_sample_weight(self):
        x, y = padded_sequences(16, micro=4, seed=1)
        # Per-token weights (Keras 3 cannot broadcast per-sample weights over
        # a per-token mask).
        sw = np.linspace(0.2, 2.0, x.size).reshape(x.shape).astype("float32")
        expected, exact, naive = _three_runs(
            sequence_model,
            x,
            y,
            micro=4,
            steps=2,
            loss=_ce(),
            sample_weight=sw,
        )
        tu.assert_same_trajectory(self, expected, exact, atol=1e-5)
        self.assertGreater(tu.trajectory_diff(expected, naive), 1e-3)


class SampleWeightReductionTest(tf.test.TestCase):
    def setUp(self):
        super().setUp()
        if tu.TF_KERAS:
            self.skipTest("tf_keras has no mean_with_sample_weight reduction")

    def test_mean_with_sample_weight(self):
        x, y = tu.classification_data(16)
        # Sample-weight sums differ 20 to 1 between the two micro-batches of
        # each window.
        sw = np.where(np.arange(16) // 4 % 2 == 0, 5.0, 0.25)
        sw = sw.astype("float32")
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
        expected, exact, naive = _three_runs(
            lambda cls, **kw: tu.mlp(cls, **kw),
            x,
            y,
            micro=4,
            steps=2,
            loss=loss,
            epochs=2,
            sample_weight=sw,
        )
        tu.assert_same_trajectory(self, expected, exact, atol=1e-5)
        self.assertGreater(tu.trajectory_diff(expected, naive), 1e-3)


class MultiOutputTest(tf.test.TestCase):
    def _build(self, cls, **kwargs):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(5, activation="tanh")(inputs)
        a = keras.layers.Dense(2, name="a")(h)
        b = keras.layers.Dense(3, name="b")(h)
        return cls(inputs=inputs, outputs={"a": a, "b": b}, **kwargs)

    def test_per_output_losses_and_loss_weights(self):
        rng = np.random.default_rng(0)
        n = 22  # A short last micro-batch: weights 4, 4, 4, 4, 4, 2.
        x = rng.normal(size=(n, 4)).astype("float32")
        y = {
            "a": rng.normal(size=(n, 2)).astype("float32"),
            "b": rng.integers(0, 3, size=(n,)).astype("int32"),
        }
        loss = {"a": "mse", "b": _ce()}
        compile_kwargs = {"loss_weights": {"a": 0.5, "b": 2.0}}
        reference = self._build(keras.Model)
        model = tu.copy_weights(
            reference, self._build(AccumModel, accum_steps=3)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, expected = tu.train(
                reference, x, y, 12, 2, "sgd", loss, compile_kwargs
            )
            _, actual = tu.train(model, x, y, 4, 2, "sgd", loss, compile_kwargs)
        tu.assert_same_trajectory(self, expected, actual)
        self.assertEmpty(
            [w for w in caught if "divide by different" in str(w.message)]
        )

    def test_inexact_mix_warns(self):
        # One output masked, one not: no single weight per micro-batch is
        # exact, and the model says so.
        keras.utils.set_random_seed(0)
        inputs = keras.Input((_T,), dtype="int32")
        h = keras.layers.Embedding(_VOCAB, 4, mask_zero=True)(inputs)
        seq = keras.layers.Dense(_CLASSES, name="seq")(h)
        pooled = keras.layers.Dense(1, name="pooled")(
            keras.layers.GlobalAveragePooling1D()(h)
        )
        model = AccumModel(
            inputs=inputs, outputs={"seq": seq, "pooled": pooled}, accum_steps=2
        )
        x, y = padded_sequences(8, micro=2)
        targets = {"seq": y, "pooled": np.zeros((8, 1), "float32")}
        model.compile("sgd", loss={"seq": _ce(), "pooled": "mse"})
        with self.assertWarnsRegex(UserWarning, "divide by different"):
            model.fit(x, targets, batch_size=2, epochs=1, verbose=0)


class SumReductionTest(tf.test.TestCase):
    def test_sum_applies_the_mean_of_micro_batch_sums_and_warns(self):
        # The documented rule for reduction="sum": each update applies
        # 1/accum_steps of the large batch's summed gradient, so SGD with the
        # learning rate times accum_steps equals the large batch (full
        # windows).
        steps, micro = 3, 4
        x, y = tu.regression_data(24)
        loss = keras.losses.MeanSquaredError(reduction="sum")
        reference = tu.mlp(keras.Model)
        model = tu.copy_weights(
            reference, tu.mlp(AccumModel, accum_steps=steps)
        )
        lr = 0.01
        _, expected = tu.train(
            reference, x, y, micro * steps, 1, keras.optimizers.SGD(lr), loss
        )
        with self.assertWarnsRegex(UserWarning, "reduction='sum'"):
            _, actual = tu.train(
                model, x, y, micro, 1, keras.optimizers.SGD(lr * steps), loss
            )
        tu.assert_same_trajectory(self, expected, actual)


class HookTest(tf.test.TestCase, parameterized.TestCase):
    @parameterized.named_parameters(
        ("", False), ("with_a_micro_batch_of_padding_only", True)
    )
    def test_override_for_a_custom_token_loss(self, all_padding):
        # A custom `compute_loss` that divides by the number of non-padding
        # targets (no Keras mask involved) is exact once the hook returns
        # that count; without the override it is not.
        pad = -1

        def token_loss(y, y_pred):
            valid = tf.cast(tf.not_equal(y, pad), tf.float32)
            per_token = keras.losses.sparse_categorical_crossentropy(
                tf.maximum(y, 0), y_pred, from_logits=True
            )
            # 0 over no token, as Keras' own losses divide.
            return tf.math.divide_no_nan(
                tf.reduce_sum(per_token * valid), tf.reduce_sum(valid)
            )

        class TokenModel(AccumModel):
            def compute_loss(
                self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs
            ):
                return token_loss(y, y_pred)

        class ExactTokenModel(TokenModel):
            def compute_loss_normalizer(self, x, y, y_pred, sample_weight):
                return tf.reduce_sum(tf.cast(tf.not_equal(y, pad), tf.float32))

        class Reference(keras.Model):
            def compute_loss(
                self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs
            ):
                return token_loss(y, y_pred)

        x, y = padded_sequences(16, micro=4)
        y = np.where(x == 0, pad, y).astype("int32")
        if all_padding:
            # A micro-batch of no token weighs 0 and adds nothing; the large
            # batch it belongs to has the other micro-batch's tokens.
            y[4:8] = pad

        def build(cls, **kw):
            return sequence_model(cls, rnn=False, **kw)

        reference = build(Reference)
        exact = tu.copy_weights(
            reference, build(ExactTokenModel, accum_steps=2)
        )
        naive = tu.copy_weights(reference, build(TokenModel, accum_steps=2))
        _, expected = tu.train(reference, x, y, 8, 2, "sgd", None)
        _, got_exact = tu.train(exact, x, y, 4, 2, "sgd", None)
        self.assertEqual(exact.discarded_windows, 0)
        tu.assert_same_trajectory(self, expected, got_exact)
        if not all_padding:
            _, got_naive = tu.train(naive, x, y, 4, 2, "sgd", None)
            self.assertGreater(tu.trajectory_diff(expected, got_naive), 1e-3)


if __name__ == "__main__":
    tf.test.main()
