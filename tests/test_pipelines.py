"""AccumModel fed the way users feed `fit`, against plain large-batch Keras.

Every input kind runs `fit` on micro-batches; the ground truth is a plain
`keras.Model` trained by hand with one `train_on_batch` per window, the
window being the samples of the micro-batches the pipeline itself yielded
(so a pipeline that reorders, as `interleave` does, is compared on its own
order). Datasets whose length TensorFlow does not know (`filter`, TFRecord
shards, `from_generator`) make Keras call the train function once more at
each epoch's end, with an iterator that runs dry inside it: no state of the
window may change in that call.
"""

import os
import warnings

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from accum_model import AccumModel
from accum_model import GradientAccumulator
from accum_model.keras._adapter import keras
from tests import testing_utils as tu

_MICRO = 5
_STEPS = 4
_EPOCHS = 3
# 80 samples: 16 micro-batches an epoch, a multiple of `_STEPS`. 72: 15, the
# last one of 2 samples, so the epoch ends inside a window.
_SIZES = (("multiple", 80), ("not_multiple", 72))


def _model(cls, **kwargs):
    return tu.mlp(cls, in_dim=4, out_dim=3, **kwargs)


def _compile(model, **kwargs):
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )


def _as_arrays(batch):
    return tuple(np.asarray(part) for part in batch)


def _windows(epochs, steps, epoch_end):
    """Groups each epoch's micro-batches into the windows AccumModel applies.

    Args:
        epochs: One list of micro-batches (tuples of arrays) per epoch.
        steps: Micro-batches per window.
        epoch_end: `"apply"` closes a partial window at an epoch's end;
            `"carry"` keeps it open (a window still open after the last
            epoch is not applied by `fit`).

    Returns:
        A list of windows, each a list of micro-batches.
    """
    windows, open_window = [], []
    for micro_batches in epochs:
        for batch in micro_batches:
            open_window.append(batch)
            if len(open_window) == steps:
                windows.append(open_window)
                open_window = []
        if epoch_end == "apply" and open_window:
            windows.append(open_window)
            open_window = []
    return windows


def _concatenate(window):
    return tuple(np.concatenate(parts) for parts in zip(*window))


def _large_batch_reference(initial, windows, build=None, compile=None):
    """Plain Keras, one `train_on_batch` per window: the large batch."""
    reference = (build or (lambda: _model(keras.Model)))()
    reference.set_weights(initial)
    (compile or _compile)(reference)
    for window in windows:
        reference.train_on_batch(*_concatenate(window))
    return reference


def _write_shards(directory, x, y, shards):
    """Writes `(x, y)` to `shards` TFRecord files, in contiguous runs."""
    paths = []
    for index, rows in enumerate(np.array_split(np.arange(len(x)), shards)):
        path = os.path.join(directory, f"part-{index}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in rows:
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(
                                float_list=tf.train.FloatList(value=x[row])
                            ),
                            "y": tf.train.Feature(
                                int64_list=tf.train.Int64List(value=[y[row]])
                            ),
                        }
                    )
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def _parse(record):
    features = tf.io.parse_single_example(
        record,
        {
            "x": tf.io.FixedLenFeature([4], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return features["x"], tf.cast(features["y"], tf.int32)


class _Batches(keras.utils.Sequence):
    """A `PyDataset` (Keras 3; `Sequence` under tf_keras) of micro-batches."""

    def __init__(self, batches, **kwargs):
        super().__init__(**kwargs)
        self._batches = batches

    def __len__(self):
        return len(self._batches)

    def __getitem__(self, index):
        return self._batches[index]


class PipelineTest(tf.test.TestCase, parameterized.TestCase):
    """Each input kind equals the large batch, update by update."""

    def _fit_input(self, kind, x, y):
        """`(fit arguments, micro-batches of one epoch or of the stream)`.

        The micro-batches are read from the pipeline itself. For the kinds
        with `steps_per_epoch`, they are the stream `fit` cuts its epochs
        from.
        """
        slices = tf.data.Dataset.from_tensor_slices((x, y))
        batches = [
            (x[i : i + _MICRO], y[i : i + _MICRO])
            for i in range(0, len(x), _MICRO)
        ]
        if kind == "arrays":
            return dict(x=x, y=y, batch_size=_MICRO), None
        if kind == "dataset":
            dataset = slices.batch(_MICRO)
        elif kind == "filter":
            dataset = slices.filter(lambda a, b: True).batch(_MICRO)
        elif kind == "tfrecord":
            paths = _write_shards(self.get_temp_dir(), x, y, shards=3)
            dataset = (
                tf.data.Dataset.from_tensor_slices(paths)
                .interleave(
                    tf.data.TFRecordDataset,
                    cycle_length=2,
                    block_length=3,
                    deterministic=True,
                )
                .map(_parse)
                .batch(_MICRO)
            )
        elif kind == "from_generator":

            def samples():
                yield from zip(x, y)

            dataset = tf.data.Dataset.from_generator(
                samples,
                output_signature=(
                    tf.TensorSpec([4], tf.float32),
                    tf.TensorSpec([], tf.int32),
                ),
            ).batch(_MICRO)
        elif kind == "py_dataset":
            if tu.TF_KERAS:
                # tf_keras takes the workers in `fit`.
                return dict(x=_Batches(batches), workers=2), None
            return dict(x=_Batches(batches, workers=2)), None
        elif kind == "generator":
            steps = len(batches)

            def forever():
                while True:
                    yield from batches

            return dict(x=forever(), steps_per_epoch=steps), None
        elif kind == "repeat":
            # 7 micro-batches an epoch cut the windows of 4 mid-way.
            stream = [batches[i % len(batches)] for i in range(7 * _EPOCHS)]
            return (
                dict(x=slices.batch(_MICRO).repeat(), steps_per_epoch=7),
                [stream[e * 7 : (e + 1) * 7] for e in range(_EPOCHS)],
            )
        else:
            raise ValueError(kind)
        return dict(x=dataset), None

    def _epochs(self, kind, fit_input, stream, x, y):
        if stream is not None:
            return stream
        if "x" in fit_input and isinstance(fit_input["x"], tf.data.Dataset):
            one_epoch = [_as_arrays(b) for b in fit_input["x"]]
        else:
            one_epoch = [
                (x[i : i + _MICRO], y[i : i + _MICRO])
                for i in range(0, len(x), _MICRO)
            ]
        return [one_epoch] * _EPOCHS

    def _check(self, kind, n, epoch_end, compile_kwargs=None):
        x, y = tu.classification_data(n)
        fit_input, stream = self._fit_input(kind, x, y)
        model = _model(AccumModel, accum_steps=_STEPS, epoch_end=epoch_end)
        initial = model.get_weights()
        _compile(model, **(compile_kwargs or {}))
        model.fit(epochs=_EPOCHS, shuffle=False, verbose=0, **fit_input)

        windows = _windows(
            self._epochs(kind, fit_input, stream, x, y), _STEPS, epoch_end
        )
        reference = _large_batch_reference(initial, windows)
        self.assertEqual(
            int(model.optimizer.iterations), len(windows), "updates"
        )
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )

    @parameterized.named_parameters(
        (f"{kind}_{size_name}_{epoch_end}", kind, n, epoch_end)
        for kind in (
            "arrays",
            "dataset",
            "filter",
            "tfrecord",
            "from_generator",
            "generator",
            "py_dataset",
            "repeat",
        )
        for size_name, n in _SIZES
        for epoch_end in ("apply", "carry")
        # The kinds of known length have no dry call: one size is enough.
        if n == 72 or kind in ("filter", "tfrecord", "from_generator")
    )
    def test_equals_large_batch(self, kind, n, epoch_end):
        self._check(kind, n, epoch_end)

    @parameterized.named_parameters(
        ("xla", dict(jit_compile=True)),
        ("steps_per_execution", dict(steps_per_execution=3)),
        ("eager", dict(run_eagerly=True)),
    )
    def test_unknown_length_in_every_execution_mode(self, compile_kwargs):
        if tu.TF_KERAS and "steps_per_execution" in compile_kwargs:
            self.skipTest(
                "tf_keras refuses steps_per_execution > 1 on data of "
                "unknown size"
            )
        for n, epoch_end in ((80, "apply"), (72, "carry")):
            self._check("filter", n, epoch_end, compile_kwargs)

    def test_canary_plain_keras_steps_once_more_on_unknown_length(self):
        # A canary on Keras, not on this package: plain `fit` counts an
        # optimizer update in the dry call at the end of an epoch of
        # unknown length (Keras 3: every epoch; tf_keras: the first, before
        # it knows the epoch's length). When this fails, Keras has fixed it,
        # and docs/pipelines.md should say so.
        x, y = tu.classification_data(80)
        model = _model(keras.Model)
        _compile(model)
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda a, b: True)
            .batch(_MICRO * _STEPS)
        )
        model.fit(dataset, epochs=_EPOCHS, verbose=0)
        self.assertGreater(int(model.optimizer.iterations), 4 * _EPOCHS)

    def test_canary_keras_warnings_on_unknown_length_are_plain_keras(self):
        # A canary on Keras: Keras 3 warns "Your input ran out of data" at
        # every epoch of unknown length, and about `shuffle` (fit's default)
        # on any dataset, for plain models alike; docs/pipelines.md says so,
        # lest a user read them as accumulation failing. tf_keras is silent.
        x, y = tu.classification_data(80)
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda a, b: True)
            .batch(_MICRO)
        )
        counts = []
        for model in (
            _model(keras.Model),
            _model(AccumModel, accum_steps=_STEPS),
        ):
            _compile(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.fit(dataset, epochs=_EPOCHS, verbose=0)
            messages = [str(w.message) for w in caught]
            counts.append(
                [
                    sum(m.startswith(start) for m in messages)
                    for start in (
                        "Your input ran out of data; interrupting training.",
                        "`shuffle=True` was passed, but will be ignored",
                    )
                ]
            )
        expected = [0, 0] if tu.TF_KERAS else [_EPOCHS, 1]
        self.assertEqual(counts, [expected, expected])


class CustomLoopPipelineTest(tf.test.TestCase, parameterized.TestCase):
    """`GradientAccumulator` in a loop that draws from the iterator itself."""

    @parameterized.named_parameters(*_SIZES)
    def test_dry_call_at_epoch_end_changes_nothing(self, n):
        x, y = tu.classification_data(n)
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .filter(lambda a, b: True)
            .batch(_MICRO)
        )
        model = _model(keras.Model)
        initial = model.get_weights()
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        accumulator = GradientAccumulator(
            model.trainable_variables, accum_steps=_STEPS
        )
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def train_step(iterator):
            # The last call of an epoch raises OutOfRangeError here.
            xb, yb = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            return accumulator.step(grads, optimizer, weight=tf.shape(xb)[0])

        for _ in range(_EPOCHS):
            iterator = iter(dataset)
            while True:
                try:
                    train_step(iterator)
                except tf.errors.OutOfRangeError:
                    break
            accumulator.apply(optimizer)

        one_epoch = [_as_arrays(b) for b in dataset]
        windows = _windows([one_epoch] * _EPOCHS, _STEPS, "apply")
        reference = _large_batch_reference(initial, windows)
        self.assertEqual(int(optimizer.iterations), len(windows))
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )


class PaddedPipelineTest(tf.test.TestCase, parameterized.TestCase):
    """Padded token batches with a per-token loss: windows of tokens."""

    _VOCAB, _CLASSES = 7, 3

    def _sequence_model(self, cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(self._VOCAB, 4, mask_zero=True)(inputs)
        h = keras.layers.Dense(4, activation="tanh")(h)
        outputs = keras.layers.Dense(self._CLASSES)(h)
        return cls(inputs=inputs, outputs=outputs, **kwargs)

    def _sequences(self, n):
        rng = np.random.default_rng(1)
        lengths = rng.integers(1, 9, size=n)
        xs = [
            rng.integers(1, self._VOCAB, size=k).astype("int32")
            for k in lengths
        ]
        ys = [
            rng.integers(0, self._CLASSES, size=k).astype("int32")
            for k in lengths
        ]
        return xs, ys

    def _compile(self, model):
        model.compile(
            keras.optimizers.SGD(0.5),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    @parameterized.named_parameters(
        ("padded_batch_filter", "padded_batch"),
        ("bucket_by_sequence_length", "bucket"),
    )
    def test_token_windows_equal_large_batch(self, kind):
        xs, ys = self._sequences(30)
        dataset = tf.data.Dataset.from_generator(
            lambda: zip(xs, ys),
            output_signature=(
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None], tf.int32),
            ),
        )
        if kind == "padded_batch":
            dataset = dataset.filter(lambda a, b: True).padded_batch(4)
        else:
            dataset = dataset.bucket_by_sequence_length(
                lambda a, b: tf.shape(a)[0],
                bucket_boundaries=[3, 6],
                bucket_batch_sizes=[4, 4, 4],
            )
        one_epoch = [_as_arrays(b) for b in dataset]
        model = self._sequence_model(
            AccumModel, accum_steps=3, epoch_end="carry"
        )
        initial = model.get_weights()
        self._compile(model)
        model.fit(dataset, epochs=2, verbose=0)

        windows = _windows([one_epoch] * 2, 3, "carry")
        # A window's micro-batches padded to one length: padding is masked,
        # so the large batch's loss is the mean over the window's tokens.
        padded = []
        for window in windows:
            length = max(b[0].shape[1] for b in window)
            padded.append(
                [
                    tuple(
                        np.pad(part, ((0, 0), (0, length - part.shape[1])))
                        for part in batch
                    )
                    for batch in window
                ]
            )
        reference = _large_batch_reference(
            initial,
            padded,
            build=lambda: self._sequence_model(keras.Model),
            compile=self._compile,
        )
        self.assertEqual(int(model.optimizer.iterations), len(windows))
        tu.assert_same_trajectory(
            self, [reference.get_weights()], [model.get_weights()]
        )
