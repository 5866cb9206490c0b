"""`micro_batch_size="auto"` under a real memory limit.

The runs under the limit happen in one subprocess (tests/memory_worker.py):
TensorFlow's CPU allocator takes its limit once, at start-up
(`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB`), and a step
that needs more raises a real `tf.errors.ResourceExhaustedError`. The
references train here, without a limit: plain `keras.Model` fit at the
whole batch, and, where Dropout draws per slice, `micro_batch_size` fixed
per batch to the sizes the run under the limit used.
"""

import json
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
# Plain fit at 256 rows of 64 steps peaks near 105 MiB on this model (128
# rows of 128 steps alike), at half the rows near half of it. Each
# out-of-memory error costs about 10 s: TensorFlow's allocator waits that
# long for memory to be freed before it raises. So the runs are few.
_LIMIT_MIB = 70
_RUNS = {
    # A batch of 64 steps does not fit whole; then one of 128 steps does
    # not fit in the size the first chose.
    "auto": "auto:64,128",
    # With Dropout, AccumBatchNormalization (Keras 3) and the noise scale:
    # a batch of 8 steps runs whole, one of 64 runs out of memory.
    "extras": "auto:8,64:extras",
    "int": "200:64",
    "accum_steps": "accum:64",
    # Batches of 8 steps train whole; validation at 256 rows of 128 steps
    # does not fit, and "auto" splits training steps only.
    "validation": "auto:8:validation",
}


def _load(path):
    arrays = np.load(path)
    result = json.loads(str(arrays["result"]))
    weights = [arrays[f"w{i}"] for i in range(len(arrays.files) - 1)]
    return result, weights


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
        )
        runs = [f"{name}={spec}" for name, spec in _RUNS.items()]
        subprocess.run(
            [sys.executable, _WORKER, cls._dir, *runs],
            env=env,
            check=True,
            timeout=600,
            capture_output=True,
        )
        cls.results = {
            name: _load(os.path.join(cls._dir, f"{name}.npz")) for name in _RUNS
        }

    def assert_same_training(self, run, reference, atol=1e-5):
        result, weights = run
        expected, expected_weights = reference
        self.assertEqual(result["error"], "")
        self.assertEqual(len(weights), len(expected_weights))
        for w, e in zip(weights, expected_weights):
            np.testing.assert_allclose(w, e, atol=atol)
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(
                result["history"][key],
                expected["history"][key],
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
        # One update per batch, as plain fit makes: nothing applied twice,
        # nothing lost.
        self.assertEqual(result["iterations"], 2)
        self.assertLess(result["peak_mib"], _LIMIT_MIB)
        self.assert_same_training(
            run, memory_worker.train("plain", [64, 128], False)
        )

    def test_retry_restores_what_the_failed_attempts_wrote(self):
        # Dropout (its seed generator), AccumBatchNormalization (Keras 3),
        # the noise scale and the metrics, against a run without a limit
        # that used, per batch, the size the retries arrived at.
        run = self.results["extras"]
        result, weights = run
        self.assertNotEmpty(result["warnings"])
        self.assertEqual(result["sizes"][0], memory_worker.BATCH)
        sizes = "/".join(str(s) for s in result["sizes"])
        reference = memory_worker.train(sizes, [8, 64], True)
        # One `fit` per batch there: the epoch's mean over equal batches.
        reference[0]["history"] = {
            k: [np.mean(v)] for k, v in reference[0]["history"].items()
        }
        self.assert_same_training(run, reference)
        self.assertEqual(result["noise_scale"], reference[0]["noise_scale"])
        self.assertEqual(result["iterations"], 2)

    def test_validation_out_of_memory_says_what_to_pass(self):
        result, _ = self.results["validation"]
        self.assertIn("validation_batch_size", result["error"])
        self.assertIn("OOM when allocating", result["error"])

    @parameterized.named_parameters(
        ("int", "int", "Set a smaller micro_batch_size"),
        ("accum_steps", "accum_steps", 'Set micro_batch_size="auto"'),
    )
    def test_without_auto_the_error_says_what_to_set(self, name, advice):
        result, _ = self.results[name]
        self.assertIn(advice, result["error"])
        self.assertIn("OOM when allocating", result["error"])
        self.assertEqual(result["iterations"], 0)


class AutoTest(parameterized.TestCase):
    """Without a limit: the whole batch fits, and is one slice."""

    def test_first_batch_decides_and_later_fits_keep_it(self):
        import accum_model
        from accum_model._keras import keras

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
        self.assertEqual(history.history["micro_batch_size"], [16.0, 16.0])
        self.assertEqual(model.get_config()["micro_batch_size"], "auto")
        self.assertEqual(int(model.optimizer.iterations), 8)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        self.assertEqual(model.micro_batch_size, 16)
        # No out-of-memory error capped it: a larger batch runs whole.
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        self.assertEqual(model.micro_batch_size, 32)


if __name__ == "__main__":
    absltest.main()
