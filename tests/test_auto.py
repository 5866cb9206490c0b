"""`micro_batch_size="auto"` under a real memory limit.

The runs under the limit happen in subprocesses (tests/memory_worker.py),
started together: TensorFlow's CPU allocator takes its limit once, at
start-up (`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB`), and a
step that needs more raises a real `tf.errors.ResourceExhaustedError`,
after waiting about 10 s for memory. The references train here, without a
limit: plain `keras.Model` fit at the whole batch, `accum_steps` at the
whole batch, or, where a layer sees its slice (BatchNorm in training,
Dropout), `micro_batch_size` fixed per batch to the sizes the run under
the limit used. Under `MirroredStrategy` the reference runs in the same
subprocess, after the run, at the sizes it used (they fit).

Each scenario's lengths and limit were chosen for where its errors come:
`partial_additions` records, at each retry, how many variables had added
rows of the failed attempt; the tests check that the scenario is the one
they mean.
"""

import json
import logging
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tests import memory_worker
from tests import testing_utils as tu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER = os.path.join(_ROOT, "tests", "memory_worker.py")
# Plain fit of 256 rows of 48 steps peaks near 95 MiB on this model, 128
# rows near 53; 96 steps about twice that.
_LIMIT_MIB = 75
# Subprocesses, run at once (each error waits on the allocator), and their
# runs: `NAME=MODE:LENGTHS[:OPTION...]` (see memory_worker).
_PROCESSES = {
    "single": (
        1,
        {
            # The whole batch of 48 steps does not fit, nor 128 rows of 96
            # steps later.
            "auto": "auto:48,96",
            "accum_steps": "accum:96",
        },
    ),
    # Apart from "single": each out-of-memory error waits on the allocator,
    # and runs in one process wait one after another.
    "int": (
        1,
        {
            "int": "200:96",
            "int_evaluate": "200:96:evaluate",
        },
    ),
    "window_partial": (
        1,
        {
            # Batches of 8 steps run whole; one of 60 steps opens no window
            # (accum_steps=2): its retries add to a window that holds the
            # first batch.
            "window_partial": "auto:8,64:window",
        },
    ),
    "extras": (
        1,
        {
            # AccumBatchNormalization, the noise scale and Dropout.
            "extras": "auto:8,48:bn:dropout",
            # Batches of 8 steps train whole; validation at 256 rows of 128
            # steps does not fit whole.
            "validation": "auto:8:validation",
        },
    ),
    "window_mixed": (
        1,
        {
            "window_bn": "auto:8,64:bn:window",
            "mixed_bn": "auto:48:bn:mixed",
        },
    ),
    "mirrored": (
        2,
        {
            "mirrored_bn": "auto:48,96:bn",
            # Its reference: in the same process of two logical devices,
            # after it, at the sizes it used (they fit under the limit);
            # no second process started after the others.
            "mirrored_bn_reference": "same=mirrored_bn:48,96:bn",
        },
    ),
}


def _run_workers(directory, processes, env):
    """Runs `{name: (replicas, runs)}` in subprocesses at once."""
    started = []
    for replicas, runs in processes.values():
        command = [sys.executable, _WORKER, directory]
        if replicas > 1:
            command.append(f"--replicas={replicas}")
        command += [f"{name}={spec}" for name, spec in runs.items()]
        started.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    failures = []
    for process in started:
        output, _ = process.communicate(timeout=900)
        if process.returncode:
            failures.append(output.decode()[-3000:])
    if failures:
        raise AssertionError("\n\n".join(failures))


def _load(path):
    arrays = np.load(path)
    result = json.loads(str(arrays["result"]))
    weights = [arrays[f"w{i}"] for i in range(len(arrays.files) - 1)]
    return result, weights


def _sizes(result):
    return "/".join(str(s) for s in result["sizes"])


class AutoUnderLimitTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._dir = tempfile.mkdtemp()
        env = dict(
            os.environ,
            PYTHONPATH=_ROOT,
            TF_CPP_MIN_LOG_LEVEL="3",
            TF_CPU_ALLOCATOR_USE_BFC="true",
            TF_CPU_BFC_MEM_LIMIT_IN_MB=str(_LIMIT_MIB),
            # TensorFlow's oneDNN matrix multiply crashes (SIGSEGV) when its
            # output's allocation fails, where the other kernels raise.
            TF_ENABLE_ONEDNN_OPTS="0",
            # One operation at a time: where in a step the allocator gives
            # up, what each scenario is about, does not depend on how
            # threads interleave (on a busy machine, for one).
            TF_NUM_INTEROP_THREADS="1",
        )
        _run_workers(cls._dir, _PROCESSES, env)
        results = {
            name: _load(os.path.join(cls._dir, f"{name}.npz"))
            for _, runs in _PROCESSES.values()
            for name in runs
        }
        cls.results = results

    def assert_same_training(self, run, reference, atol=1e-5, plain=False):
        result, weights = run
        expected, expected_weights = reference
        self.assertEqual(result["error"], "")
        self.assertEqual(expected["error"], "")
        if not plain:
            # Plain fit on a dataset of unknown length counts one more
            # update at the epoch's end, on an iterator that ran dry.
            self.assertEqual(result["iterations"], expected["iterations"])
        self.assertEqual(len(weights), len(expected_weights))
        for w, e in zip(weights, expected_weights):
            np.testing.assert_allclose(w, e, atol=atol)
        # One `fit` per batch in some references: an epoch's mean over
        # equal batches.
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(
                np.mean(result["history"][key]),
                np.mean(expected["history"][key]),
                rtol=1e-5,
                err_msg=key,
            )

    def test_auto_trains_as_the_whole_batch(self):
        run = self.results["auto"]
        result, _ = run
        # The first attempt is the whole batch: it did not fit.
        first, second = result["sizes"]
        self.assertLess(first, memory_worker.BATCH)
        # Training had chosen `first`: the longer batch halved it and ran
        # again. Each halving warned.
        self.assertLess(second, first)
        self.assertEqual(result["micro_batch_size"], second)
        halvings = [w for w in result["warnings"] if "runs again" in w]
        self.assertLen(halvings, round(math.log2(memory_worker.BATCH / second)))
        # Some variables had added the failed attempt's gradient: the batch
        # opened its window, and its rerun overwrote them.
        self.assertTrue(any(result["partial_additions"]))
        self.assertEqual(result["iterations"], 2)
        self.assertLess(result["peak_mib"], _LIMIT_MIB)
        self.assert_same_training(
            run, memory_worker.train("plain", [48, 96]), plain=True
        )

    def test_retry_mid_window_adds_nothing_twice(self):
        # The window holds the first batch when the second runs out of
        # memory with some variables' additions done: they are not added
        # again (once added twice, the weights are 1e-3 off).
        run = self.results["window_partial"]
        result, _ = run
        self.assertEqual(result["sizes"][0], memory_worker.BATCH)
        self.assert_same_training(
            run, memory_worker.train("accum", [8, 64], ["window"])
        )
        # Where the allocator fails depends on how the two threads
        # interleave the step's ops: most runs fail after some additions
        # (without the guard they end 1e-3 off), some before any.
        if not any(result["partial_additions"]):
            self.skipTest("This run ran out of memory before any addition.")

    def assert_trains_as_at_its_sizes(self, name, reference, tolerance=1e-5):
        """Run `name` against `reference`, a run with no out-of-memory error
        that used, per batch, the size the retries arrived at: `(lengths,
        options)` trained here without a limit, or the name of a run in the
        same process."""
        run = self.results[name]
        result, _ = run
        if isinstance(reference, str):
            reference = self.results[reference]
        else:
            lengths, options = reference
            reference = memory_worker.train(_sizes(result), lengths, options)
        self.assert_same_training(run, reference, atol=tolerance)
        np.testing.assert_allclose(
            result["noise_scale"], reference[0]["noise_scale"], rtol=tolerance
        )
        return result, reference[0]

    def test_retry_restores_what_the_failed_attempts_wrote(self):
        # Dropout (its seed generator), AccumBatchNormalization, the noise
        # scale and the metrics.
        result, _ = self.assert_trains_as_at_its_sizes(
            "extras", ([8, 48], ["bn", "dropout"])
        )
        self.assertNotEmpty(result["warnings"])
        self.assertEqual(result["sizes"][0], memory_worker.BATCH)

    def test_mid_window_with_accum_batchnorm(self):
        # accum_steps=2: the second batch runs out of memory while the
        # window holds the first; its errors come before any addition.
        result, _ = self.assert_trains_as_at_its_sizes(
            "window_bn", ([8, 64], ["bn", "window"])
        )
        self.assertEqual(result["partial_additions"], [0, 0])
        self.assertEqual(result["iterations"], 1)

    def test_mixed_float16(self):
        # The loss scale moves once per batch, not once per attempt: its
        # run equals one without a limit.
        result, _ = self.assert_trains_as_at_its_sizes(
            "mixed_bn", ([48], ["bn", "mixed"]), tolerance=1e-3
        )
        self.assertNotEmpty(result["warnings"])

    def test_mirrored_strategy_on_two_devices(self):
        # Each replica halves its own shard's slices and keeps its own
        # window state; the reference ran after it, in its process, at its
        # sizes: without an out-of-memory error.
        result, reference = self.assert_trains_as_at_its_sizes(
            "mirrored_bn", "mirrored_bn_reference"
        )
        self.assertNotEmpty(result["warnings"])
        self.assertEqual(result["iterations"], 2)
        self.assertEqual(reference["warnings"], [])
        self.assertEqual(reference["sizes"], result["sizes"])

    def test_validation_splits_too(self):
        # Validation at the whole batch does not fit: it halves for
        # evaluation alone, and its loss and metrics are plain fit's.
        run = self.results["validation"]
        result, _ = run
        self.assertEqual(result["error"], "")
        self.assertTrue(any("evaluate" in w for w in result["warnings"]))
        # Training's own size stayed: its batches ran whole.
        self.assertEqual(result["micro_batch_size"], memory_worker.BATCH)
        reference = memory_worker.train("plain", [8], ["validation"])
        for key in ("val_loss", "val_accuracy"):
            np.testing.assert_allclose(
                result["history"][key],
                reference[0]["history"][key],
                rtol=1e-5,
                err_msg=key,
            )

    @parameterized.named_parameters(
        ("int", "int", "Set a smaller micro_batch_size"),
        ("int_evaluate", "int_evaluate", "Set a smaller micro_batch_size"),
        ("accum_steps", "accum_steps", 'Set micro_batch_size="auto"'),
    )
    def test_without_auto_the_error_says_what_to_set(self, name, advice):
        result, _ = self.results[name]
        self.assertIn(advice, result["error"])
        # Once, also where `fit` and `evaluate` both say it.
        self.assertEqual(result["error"].count("A step ran out of memory"), 1)
        self.assertIn("OOM when allocating", result["error"])
        self.assertEqual(result["iterations"], 0)


class AutoTest(parameterized.TestCase):
    """Without a limit: the whole batch fits, and is one slice."""

    def test_first_batch_decides_and_later_fits_keep_it(self):
        import accum_model
        from accum_model.keras._adapter import keras

        x, y = tu.classification_data(64, in_dim=6)
        model = tu.mlp(
            accum_model.AccumModel, in_dim=6, micro_batch_size="auto"
        )
        self.assertEqual(model.micro_batch_size, "auto")
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        self.assertEqual(model.micro_batch_size, 16)
        # In the epochs' logs, as an int.
        self.assertEqual(history.history["micro_batch_size"], [16, 16])
        self.assertIsInstance(history.history["micro_batch_size"][0], int)
        self.assertEqual(model.get_config()["micro_batch_size"], "auto")
        self.assertEqual(int(model.optimizer.iterations), 8)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        self.assertEqual(model.micro_batch_size, 16)
        # No out-of-memory error capped it: a larger batch runs whole.
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        self.assertEqual(model.micro_batch_size, 32)
        # "auto" again starts over.
        model.micro_batch_size = "auto"
        self.assertEqual(model.micro_batch_size, "auto")

    def test_no_retracing_warning_from_the_package(self):
        import accum_model
        from accum_model.keras._adapter import keras

        x, y = tu.classification_data(96, in_dim=6)
        model = tu.mlp(
            accum_model.AccumModel, in_dim=6, micro_batch_size="auto"
        )
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        logger = logging.getLogger("tensorflow")
        with self.assertLogs(logger, level="WARNING") as captured:
            logger.warning("The capture's own line.")
            for batch_size in (8, 16, 24, 32, 48, 96, 8):
                model.fit(x, y, batch_size=batch_size, verbose=0)
                model.evaluate(x, y, batch_size=batch_size, verbose=0)
                model.predict(x, batch_size=batch_size, verbose=0)
        self.assertEqual(
            [line for line in captured.output if "retracing" in line], []
        )


if __name__ == "__main__":
    absltest.main()
