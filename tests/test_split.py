"""`micro_batch_size`: a batch split inside the step trains as the batch.

The ground truth is plain `keras.Model` fit at the same batch size, from
the same weights: the weights after every update, the number of updates,
the logged loss and metrics, and what callbacks count. Where a plain model
cannot be the same (BatchNorm normalizes each slice by its own moments; the
noise scale and AdaScale need a window), the truth is `accum_steps` over
batches of the slice's size, which the other test modules hold to plain
Keras.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import accum_model
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

AccumModel = accum_model.AccumModel
# 100 rows in batches of 32: 32, 32, 32 and a short last batch of 4.
ROWS = 100
BATCH = 32


def _classifier(cls, seed=0, **kwargs):
    return tu.mlp(cls, in_dim=6, out_dim=3, hidden=8, seed=seed, **kwargs)


def _fit(model, x, y=None, batch_size=BATCH, epochs=2, **kwargs):
    compile_kwargs = kwargs.pop("compile_kwargs", {})
    model.compile(
        optimizer=kwargs.pop("optimizer", None) or tu.OPTIMIZERS["momentum"](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    recorder = tu.UpdateRecorder()
    counter = _BatchCounter()
    history = model.fit(
        x,
        y,
        batch_size=None if y is None else batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, counter],
        **kwargs,
    )
    return history.history, recorder.weights, counter.batches


class _BatchCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def _unknown_length(x, y, batch_size):
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .filter(lambda a, b: True)
        .batch(batch_size)
    )


def _generator(x, y, batch_size):
    def generate():
        for i in range(0, len(x), batch_size):
            yield x[i : i + batch_size], y[i : i + batch_size]

    return tf.data.Dataset.from_generator(
        generate,
        output_signature=(
            tf.TensorSpec((None, x.shape[1]), tf.float32),
            tf.TensorSpec((None,), tf.int32),
        ),
    )


class SplitFitTest(parameterized.TestCase):
    """Against plain fit at the full batch."""

    def assert_like_plain(self, plain, split, atol=1e-5, loss=True):
        history, weights, batches = plain
        split_history, split_weights, split_batches = split
        tu.assert_same_trajectory(self, weights, split_weights, atol=atol)
        self.assertEqual(batches, split_batches, "callback batches")
        for key in ("loss", "accuracy") if loss else ("accuracy",):
            np.testing.assert_allclose(
                split_history[key], history[key], rtol=atol, err_msg=key
            )

    @parameterized.named_parameters(
        # 32 = 4 * 7 + 4; the short last batch (4 rows) is one short slice.
        ("uneven", 7),
        ("one_row", 1),
        ("divides", 8),
        # Larger than the batch: no split, one slice.
        ("larger_than_batch", 64),
    )
    def test_numpy(self, size):
        x, y = tu.classification_data(ROWS, in_dim=6)
        plain = _fit(_classifier(keras.Model), x, y)
        # The noise scale changes no update; it shows the slices: a batch
        # measures when it held two or more.
        model = _classifier(AccumModel, micro_batch_size=size, noise_scale=True)
        split = _fit(model, x, y)
        self.assert_like_plain(plain, split)
        batches = [BATCH] * (ROWS // BATCH) + [ROWS % BATCH]
        measured = 2 * sum(-(-b // size) >= 2 for b in batches)
        self.assertEqual(
            model.gradient_accumulator.noise_scale.measurements, measured
        )

    @parameterized.named_parameters(
        ("unknown_length", _unknown_length), ("generator", _generator)
    )
    def test_pipelines(self, pipeline):
        x, y = tu.classification_data(ROWS, in_dim=6)
        # The reference: NumPy input, whose length Keras knows.
        plain = _fit(_classifier(keras.Model), x, y)
        split = _fit(
            _classifier(AccumModel, micro_batch_size=7),
            pipeline(x, y, BATCH),
        )
        self.assert_like_plain(plain, split)

    def test_tfrecords(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        path = self.create_tempfile("rows.tfrecord").full_path
        with tf.io.TFRecordWriter(path) as writer:
            for xi, yi in zip(x, y):
                features = {
                    "x": tf.train.Feature(
                        float_list=tf.train.FloatList(value=xi)
                    ),
                    "y": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[yi])
                    ),
                }
                example = tf.train.Example(
                    features=tf.train.Features(feature=features)
                )
                writer.write(example.SerializeToString())
        spec = {
            "x": tf.io.FixedLenFeature([6], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
        }

        def parse(record):
            parsed = tf.io.parse_single_example(record, spec)
            return parsed["x"], tf.cast(parsed["y"], tf.int32)

        dataset = tf.data.TFRecordDataset(path).map(parse).batch(BATCH)
        plain = _fit(_classifier(keras.Model), x, y)
        split = _fit(_classifier(AccumModel, micro_batch_size=5), dataset)
        self.assert_like_plain(plain, split)

    def test_sparse_inputs(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        x[x < 0.3] = 0.0

        def model(cls, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,), sparse=True)
            return cls(inputs, keras.layers.Dense(3)(inputs), **kwargs)

        def dataset():
            return tf.data.Dataset.from_tensor_slices(
                (tf.sparse.from_dense(x), y)
            ).batch(BATCH)

        plain = _fit(model(keras.Model), dataset())
        split_model = model(AccumModel, micro_batch_size=7, noise_scale=True)
        split = _fit(split_model, dataset())
        self.assert_like_plain(plain, split)
        # 3 batches of 32 an epoch in slices, the batch of 4 in one.
        self.assertEqual(
            split_model.gradient_accumulator.noise_scale.measurements, 6
        )

    def test_ragged_inputs_of_a_subclassed_model(self):
        rng = np.random.default_rng(0)
        rows = [
            rng.normal(size=(rng.integers(1, 5), 3)).astype("float32")
            for _ in range(40)
        ]
        x = tf.ragged.constant(rows, ragged_rank=1)
        y = rng.integers(0, 3, 40).astype("int32")

        def model(base, **kwargs):
            class Mean(base):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.dense = keras.layers.Dense(3)

                def call(self, inputs):
                    return self.dense(tf.reduce_mean(inputs, axis=1))

            keras.utils.set_random_seed(0)
            m = Mean(**kwargs)
            m(x[:2])
            return m

        def dataset():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

        plain = _fit(model(keras.Model), dataset())
        split = _fit(model(AccumModel, micro_batch_size=3), dataset())
        self.assert_like_plain(plain, split)

    @parameterized.named_parameters(
        ("jit_compile", dict(jit_compile=True)),
        ("steps_per_execution", dict(steps_per_execution=3)),
    )
    def test_compile_options(self, compile_kwargs):
        if tu.TF_KERAS and "jit_compile" in compile_kwargs:
            self.skipTest("tf_keras' XLA fit is covered by test_model.")
        x, y = tu.classification_data(ROWS, in_dim=6)
        plain = _fit(
            _classifier(keras.Model), x, y, compile_kwargs=compile_kwargs
        )
        split = _fit(
            _classifier(AccumModel, micro_batch_size=7),
            x,
            y,
            compile_kwargs=compile_kwargs,
        )
        self.assert_like_plain(plain, split)

    def test_learning_rate_schedule_steps_per_batch(self):
        x, y = tu.classification_data(ROWS, in_dim=6)

        def optimizer():
            schedule = keras.optimizers.schedules.ExponentialDecay(
                0.2, decay_steps=1, decay_rate=0.5
            )
            return keras.optimizers.SGD(schedule)

        plain = _fit(_classifier(keras.Model), x, y, optimizer=optimizer())
        split = _fit(
            _classifier(AccumModel, micro_batch_size=5),
            x,
            y,
            optimizer=optimizer(),
        )
        self.assert_like_plain(plain, split)

    @parameterized.named_parameters(
        # 80 rows: batches of 32, 32, 16. Windows of two batches: (32, 32)
        # and the last batch alone, applied at the epoch's end.
        ("apply", "apply"),
    )
    def test_windows_of_batches(self, epoch_end):
        x, y = tu.classification_data(80, in_dim=6)
        plain = _fit(_classifier(keras.Model), x, y, batch_size=2 * BATCH)
        split = _fit(
            _classifier(
                AccumModel,
                micro_batch_size=7,
                accum_steps=2,
                epoch_end=epoch_end,
            ),
            x,
            y,
        )
        history, weights, _ = plain
        split_history, split_weights, split_batches = split
        tu.assert_same_trajectory(self, weights, split_weights)
        # One callback batch per batch of 32: 3 an epoch.
        self.assertEqual(split_batches, 6)

    def test_saved_mid_window_continues(self):
        # Windows of two split batches; saved after the first batch of the
        # second epoch (a window open), loaded into a new model, continued:
        # the uninterrupted run's weights.
        x, y = tu.classification_data(96, in_dim=6)

        def make():
            model = _classifier(AccumModel, micro_batch_size=7, accum_steps=2)
            model.compile(
                optimizer=tu.OPTIMIZERS["momentum"](),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
            return model

        def fit(model, rows, epochs=1):
            model.fit(
                x[rows],
                y[rows],
                batch_size=BATCH,
                epochs=epochs,
                shuffle=False,
                verbose=0,
            )

        first, rest = slice(0, BATCH), slice(BATCH, 96)
        uninterrupted = make()
        fit(uninterrupted, slice(0, 96))
        uninterrupted.epoch_end = "carry"
        fit(uninterrupted, first)
        fit(uninterrupted, rest)

        model = make()
        fit(model, slice(0, 96))
        model.epoch_end = "carry"
        fit(model, first)
        self.assertEqual(int(model.gradient_accumulator.micro_step), 1)
        path = self.create_tempdir().full_path + "/mid_window.keras"
        model.save(path)
        restored = keras.models.load_model(path)
        self.assertEqual(restored.micro_batch_size, 7)
        self.assertEqual(int(restored.gradient_accumulator.micro_step), 1)
        fit(restored, rest)
        self.assertLessEqual(
            tu.max_abs_diff(
                uninterrupted.get_weights(), restored.get_weights()
            ),
            1e-6,
        )

    def test_mixed_float16(self):
        tu.use_policy(self, "mixed_float16")
        x, y = tu.classification_data(ROWS, in_dim=6)
        plain = _fit(_classifier(keras.Model), x, y)
        split = _fit(_classifier(AccumModel, micro_batch_size=7), x, y)
        # float16 activations: a slice's are rounded as the batch's are,
        # but summed in another order.
        self.assert_like_plain(plain, split, atol=1e-3)

    def test_per_token_loss_with_padding(self):
        # Sequences padded with 0; Keras divides the loss by the tokens
        # that are not padding, so slices weigh by their tokens.
        rng = np.random.default_rng(0)
        lengths = rng.integers(1, 9, size=48)
        x = np.zeros((48, 8), "int32")
        for i, n in enumerate(lengths):
            x[i, :n] = rng.integers(1, 20, size=n)
        y = (x * 7 + 3) % 5

        def model(cls, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((8,), dtype="int32")
            h = keras.layers.Embedding(20, 6, mask_zero=True)(inputs)
            outputs = keras.layers.Dense(5)(h)
            return cls(inputs, outputs, **kwargs)

        plain = _fit(model(keras.Model), x, y, batch_size=16)
        split = _fit(model(AccumModel, micro_batch_size=5), x, y, batch_size=16)
        # tf_keras' compiled loss logs each slice's loss itself, weighted by
        # its samples, not its tokens (docs/micro_batch.md).
        self.assert_like_plain(plain, split, loss=not tu.TF_KERAS)

    @parameterized.named_parameters(
        ("sequential", "sequential"), ("subclassed", "subclassed")
    )
    def test_model_built_by_its_first_step(self, kind):
        # No `Input`: the weights are created in the first traced step,
        # which must not happen inside the slices' loop.
        x, y = tu.classification_data(ROWS, in_dim=6)

        def model(base, **kwargs):
            keras.utils.set_random_seed(0)
            if kind == "sequential":
                m = keras.Sequential(
                    [
                        keras.layers.Dense(8, activation="tanh"),
                        keras.layers.Dense(3),
                    ]
                )
                return accum_model.accumulate(m, **kwargs) if kwargs else m

            class Net(base):
                def __init__(self, **kw):
                    super().__init__(**kw)
                    self.hidden = keras.layers.Dense(8, activation="tanh")
                    self.out = keras.layers.Dense(3)

                def call(self, inputs):
                    return self.out(self.hidden(inputs))

            return Net(**kwargs)

        plain = _fit(model(keras.Model), x, y)
        split = _fit(model(AccumModel, micro_batch_size=7), x, y)
        self.assert_like_plain(plain, split)

    def test_accumulate_front_end(self):
        x, y = tu.classification_data(ROWS, in_dim=6)
        plain = _fit(_classifier(keras.Model), x, y)
        model = accum_model.accumulate(
            _classifier(keras.Model), micro_batch_size=7
        )
        self.assertEqual(model.accum_steps, 1)
        self.assertEqual(model.micro_batch_size, 7)
        split = _fit(model, x, y)
        self.assert_like_plain(plain, split)


class _MeanOfActivations(keras.layers.Layer):
    """Adds the mean over the batch of its inputs' squares, as a loss."""

    def call(self, inputs):
        self.add_loss(0.01 * tf.reduce_mean(tf.square(inputs)))
        return inputs


def _loss_model(cls, case, **kwargs):
    """The model of a `LossTest` case: one output, or two with weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    regularizer = (
        keras.regularizers.L2(0.01) if case == "regularizers" else None
    )
    h = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=regularizer,
        activity_regularizer=regularizer,
    )(inputs)
    if case == "add_loss":
        h = _MeanOfActivations()(h)
    if case == "two_outputs":
        outputs = {
            "a": keras.layers.Dense(3, name="a")(h),
            "b": keras.layers.Dense(2, name="b")(h),
        }
    else:
        outputs = keras.layers.Dense(3)(h)
    return cls(inputs, outputs, **kwargs)


def _loss_case(case):
    """`(loss, compile keywords, fit keywords)` of a `LossTest` case."""
    rng = np.random.default_rng(1)
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    weights = rng.uniform(0.0, 2.0, size=(ROWS,)).astype("float32")
    mse = keras.losses.MeanSquaredError
    if case == "sum":
        return mse(reduction="sum"), {}, {"y": y}
    if case == "mean_with_sample_weight":
        return (
            mse(reduction="mean_with_sample_weight"),
            {},
            {"y": y, "sample_weight": weights},
        )
    if case == "sample_weight":
        return mse(), {}, {"y": y, "sample_weight": weights}
    if case == "class_weight":
        labels = rng.integers(0, 3, size=(ROWS,)).astype("int32")
        return (
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            {},
            {"y": labels, "class_weight": {0: 0.5, 1: 2.0, 2: 1.0}},
        )
    if case == "function":
        return (
            (lambda t, p: tf.reduce_mean(tf.abs(t - p), axis=-1)),
            {},
            {"y": y},
        )
    if case == "two_outputs":
        targets = {"a": y, "b": y[:, :2]}
        return (
            {"a": mse(), "b": keras.losses.MeanAbsoluteError()},
            {"loss_weights": {"a": 1.0, "b": 0.3}},
            {"y": targets},
        )
    return mse(), {}, {"y": y}


class LossTest(parameterized.TestCase):
    """Every loss the step takes: a batch in slices is the whole batch."""

    @parameterized.named_parameters(
        ("sum", "sum"),
        ("sum_over_batch_size", "mean"),
        ("mean_with_sample_weight", "mean_with_sample_weight"),
        ("sample_weight", "sample_weight"),
        ("class_weight", "class_weight"),
        ("plain_function", "function"),
        ("add_loss", "add_loss"),
        ("regularizers", "regularizers"),
        ("two_outputs_loss_weights", "two_outputs"),
    )
    def test_slices_train_as_the_whole_batch(self, case):
        if tu.TF_KERAS and case == "mean_with_sample_weight":
            self.skipTest("A Keras 3 reduction.")
        x, _ = tu.classification_data(ROWS, in_dim=6)
        loss, compile_kwargs, fit_kwargs = _loss_case(case)
        y = fit_kwargs.pop("y")
        runs = []
        for cls, kwargs in (
            (keras.Model, {}),
            (AccumModel, {"micro_batch_size": 7}),
        ):
            model = _loss_model(cls, case, **kwargs)
            model.compile(
                optimizer=keras.optimizers.SGD(0.05),
                loss=loss,
                **compile_kwargs,
            )
            recorder = tu.UpdateRecorder()
            history = model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[recorder],
                **fit_kwargs,
            )
            runs.append((history.history, recorder.weights))
        (history, weights), (split_history, split_weights) = runs
        tu.assert_same_trajectory(self, weights, split_weights)
        self.assertLen(split_weights, len(weights))
        if not tu.TF_KERAS:
            # tf_keras' compiled loss logs each slice's loss itself.
            np.testing.assert_allclose(
                split_history["loss"], history["loss"], rtol=1e-5
            )

    def test_sum_with_additional_losses_warns(self):
        # Each slice adds the model's regularization once: with a loss that
        # sums over the batch no weight per slice counts it once.
        x, _ = tu.classification_data(ROWS, in_dim=6)
        loss, _, fit_kwargs = _loss_case("sum")
        model = _loss_model(AccumModel, "regularizers", micro_batch_size=7)
        model.compile(optimizer="sgd", loss=loss)
        with self.assertWarnsRegex(UserWarning, "add_loss"):
            model.fit(x, fit_kwargs["y"], batch_size=BATCH, verbose=0)


class BatchnormTest(parameterized.TestCase):
    def test_moving_statistics_of_the_whole_batch(self):
        # At learning rate 0 the weights stay, so plain BatchNormalization at
        # the whole batch is the truth for the moving statistics: moved once
        # per batch, from the batch's moments.
        if tu.TF_KERAS:
            self.skipTest("AccumBatchNormalization needs Keras 3.")
        x, y = tu.classification_data(ROWS, in_dim=6)

        def make(cls, bn, **kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            h = keras.layers.Dense(8)(inputs)
            h = bn(momentum=0.5)(h)
            outputs = keras.layers.Dense(3)(h)
            return cls(inputs, outputs, **kwargs)

        plain = make(keras.Model, keras.layers.BatchNormalization)
        split = make(
            AccumModel, accum_model.AccumBatchNormalization, micro_batch_size=7
        )
        for model in (plain, split):
            _fit(model, x, y, optimizer=keras.optimizers.SGD(0.0))
        for a, b in zip(
            plain.non_trainable_weights, split.non_trainable_weights
        ):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


class SplitWindowTest(parameterized.TestCase):
    """Against `accum_steps` over batches of the slice's size."""

    def _pair(self, make, x, y, **kwargs):
        windows = make(accum_steps=4, **kwargs)
        split = make(micro_batch_size=8, **kwargs)
        # 96 rows: 3 batches of 32, each 4 slices of 8.
        windows_run = _fit(windows, x, y, batch_size=8, epochs=1)
        split_run = _fit(split, x, y, batch_size=32, epochs=1)
        tu.assert_same_trajectory(self, windows_run[1], split_run[1])
        return windows, split

    def test_noise_scale_counts_slices(self):
        x, y = tu.classification_data(96, in_dim=6)

        def make(**kwargs):
            return _classifier(AccumModel, noise_scale=True, **kwargs)

        windows, split = self._pair(make, x, y)
        # Measured at accum_steps=1: each slice is a sample.
        self.assertEqual(split.accum_steps, 1)
        self.assertEqual(split.gradient_accumulator.noise_scale.measurements, 3)
        np.testing.assert_allclose(
            split.gradient_noise_scale, windows.gradient_noise_scale, rtol=1e-4
        )

    def test_adascale(self):
        x, y = tu.classification_data(96, in_dim=6)

        def make(**kwargs):
            return _classifier(
                AccumModel,
                adascale=accum_model.AdaScale(base_batch=8),
                **kwargs,
            )

        windows, split = self._pair(make, x, y)
        np.testing.assert_allclose(
            split.adascale_gain, windows.adascale_gain, rtol=1e-4
        )
        np.testing.assert_allclose(
            split.adascale_tau, windows.adascale_tau, rtol=1e-4
        )

    def test_accum_batchnorm_moments_of_the_batch(self):
        if tu.TF_KERAS:
            self.skipTest("AccumBatchNormalization needs Keras 3.")
        x, y = tu.classification_data(96, in_dim=6)

        def make(**kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            h = keras.layers.Dense(8)(inputs)
            h = accum_model.AccumBatchNormalization()(h)
            outputs = keras.layers.Dense(3)(h)
            return AccumModel(inputs, outputs, **kwargs)

        windows, split = self._pair(make, x, y)
        for a, b in zip(
            windows.non_trainable_weights, split.non_trainable_weights
        ):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)

    def test_an_empty_batch_opening_a_window(self):
        # One replica: an empty batch adds nothing and the next batch
        # overwrites what the last window left, as accum_steps' micro-batch
        # of no rows adds zeros.
        rng = np.random.default_rng(0)
        sizes = [4, 4, 0, 4, 4, 4]
        xs = [rng.normal(size=(n, 3)).astype("float32") for n in sizes]
        ys = [rng.normal(size=(n, 2)).astype("float32") for n in sizes]

        def batches():
            return tf.data.Dataset.from_generator(
                lambda: zip(xs, ys),
                output_signature=(
                    tf.TensorSpec((None, 3)),
                    tf.TensorSpec((None, 2)),
                ),
            )

        def make(**kwargs):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((3,))
            model = AccumModel(inputs, keras.layers.Dense(2)(inputs), **kwargs)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            model.fit(batches(), verbose=0)
            return model

        windows = make(accum_steps=2)
        split = make(accum_steps=2, micro_batch_size=2)
        self.assertEqual(int(split.optimizer.iterations), 3)
        for a, b in zip(windows.get_weights(), split.get_weights()):
            np.testing.assert_allclose(b, a, atol=1e-6)


class SettingTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("zero", 0),
        ("negative", -1),
        ("float", 2.5),
        ("string", "16"),
        ("bool", True),
        ("other_mode", "automatic"),
    )
    def test_refused_before_anything_changes(self, value):
        with self.assertRaisesRegex(ValueError, "micro_batch_size"):
            _classifier(AccumModel, micro_batch_size=value)
        model = _classifier(keras.Model)
        with self.assertRaisesRegex(ValueError, "micro_batch_size"):
            accum_model.accumulate(model, micro_batch_size=value)
        self.assertNotIsInstance(model, AccumModel)
        model = _classifier(AccumModel, micro_batch_size=4)
        with self.assertRaisesRegex(ValueError, "micro_batch_size"):
            model.micro_batch_size = value
        self.assertEqual(model.micro_batch_size, 4)

    def test_config_round_trip(self):
        for value in (None, 4, "auto"):
            model = _classifier(AccumModel, micro_batch_size=value)
            config = model.get_config()
            self.assertEqual(config.get("micro_batch_size"), value)
            clone = AccumModel.from_config(config)
            self.assertEqual(clone.micro_batch_size, value)

    def test_saved_model_keeps_the_setting(self):
        model = _classifier(AccumModel, micro_batch_size=4)
        model.compile(optimizer="sgd", loss="mse")
        path = self.create_tempdir().full_path + "/model.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.micro_batch_size, 4)

    def test_auto_given_as_accum_steps_points_to_micro_batch_size(self):
        with self.assertRaisesRegex(ValueError, 'micro_batch_size="auto"'):
            accum_model.accumulate(_classifier(keras.Model), "auto")

    def test_misspelled_keyword(self):
        with self.assertRaisesRegex(TypeError, "micro_batch_size"):
            _classifier(AccumModel, micro_batchsize=4)

    @parameterized.named_parameters(
        ("micro_batch_size", "micro_batch_size", 8),
        ("accum_steps", "accum_steps", 4),
    )
    def test_given_to_fit_points_to_the_model(self, name, value):
        # A natural first guess: Keras' own message would not say where it
        # goes. Nothing changes.
        x, y = tu.classification_data(ROWS, in_dim=6)
        model = _classifier(AccumModel)
        model.compile(optimizer="sgd", loss="mse")
        with self.assertRaisesRegex(
            TypeError, f"`fit` does not take `{name}`.*accumulate"
        ):
            model.fit(x, y, verbose=0, **{name: value})
        self.assertIsNone(model.gradient_accumulator)

    def test_accumulate_options_are_keyword_only(self):
        # `accumulate(m, 4, 8)` once took 8 for `epoch_end`.
        with self.assertRaisesRegex(TypeError, "positional"):
            accum_model.accumulate(_classifier(keras.Model), 4, 8)


_WEIGHT_WORKER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "weight_memory_worker.py"
)


class MemoryTest(absltest.TestCase):
    def test_split_holds_what_accumulation_holds(self):
        # A model whose weights dominate (tests/weight_memory_worker.py),
        # each way in its own process under the BFC allocator: the split
        # at E holds what accum_steps holds at E / N (its slices added in
        # place, nothing the size of the weights beside the window), give
        # or take a fifth of a weight copy; the whole batch's inputs are
        # small here.
        env = dict(os.environ, TF_USE_LEGACY_KERAS="0")
        env.setdefault("PYTHONPATH", os.getcwd())
        started = {
            mode: subprocess.Popen(
                [sys.executable, _WEIGHT_WORKER, mode, "64", "4"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for mode in ("accum", "split")
        }
        peaks = {}
        for mode, process in started.items():
            out, err = process.communicate(timeout=600)
            self.assertEqual(process.returncode, 0, err.decode()[-3000:])
            peaks[mode] = json.loads(out.decode().strip().splitlines()[-1])
        copy = peaks["accum"]["weight_bytes"]
        self.assertLessEqual(
            peaks["split"]["peak"], peaks["accum"]["peak"] + copy / 5, peaks
        )


if __name__ == "__main__":
    absltest.main()
