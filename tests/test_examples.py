"""The examples run end to end, with their flags, on tiny sizes."""

import math
import os
import subprocess
import sys

import tensorflow as tf

from tests import testing_utils as tu

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(name, *flags):
    env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, os.path.join(_ROOT, "examples", name), *flags],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


class TrainExampleTest(tf.test.TestCase):
    def test_accumulated_run_matches_large_batch(self):
        result = _run_example(
            "train.py",
            "--samples=600",
            "--width=32",
            "--batch_size=16",
            "--accum_steps=4",
            "--epochs=1",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("accum matches the large batch", result.stdout)
        self.assertIn("accum (B=16, N=4)", result.stdout)

    def test_a_run_that_dies_is_reported_not_waited_for(self):
        # A training process that exits without a result (a crash in
        # TensorFlow) stops the example with its exit code, instead of a
        # wait for a result that never comes.
        code = (
            "import multiprocessing, sys\n"
            f"sys.path.insert(0, {os.path.join(_ROOT, 'examples')!r})\n"
            "import peak_memory\n"
            "context = multiprocessing.get_context('spawn')\n"
            "process = context.Process(target=sys.exit, args=(3,))\n"
            "process.start()\n"
            "peak_memory.result_of(process, context.Queue())\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("exited with code 3 without a result", result.stderr)


class PaddedSequencesExampleTest(tf.test.TestCase):
    def test_exact_normalization_beats_naive_averaging(self):
        result = _run_example(
            "padded_sequences.py",
            "--batch_size=4",
            "--accum_steps=3",
            "--max_len=12",
            "--units=4",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn(
            "exact normalization matches the large batch", result.stdout
        )
        rows = {
            line[:24].strip(): float(line.split()[-1])
            for line in result.stdout.splitlines()
            if line.startswith(("exact (", "naive ("))
        }
        self.assertLess(rows["exact (valid tokens)"], 1e-4)
        self.assertGreater(rows["naive (sample count)"], 1e-2)


@tu.skip_unless_available("keras_hub")
class FinetuneKerasHubExampleTest(tf.test.TestCase):
    def test_accumulate_matches_large_batch_and_builtin_does_not(self):
        result = _run_example(
            "finetune_keras_hub.py",
            "--texts=24",
            "--epochs=1",
            "--batch_size=2",
            "--accum_steps=3",
            "--sequence_length=8",
            "--hidden_dim=8",
            "--num_layers=1",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("accumulate matches the large batch", result.stdout)
        rows = {
            line[:30].strip(): line.split()
            for line in result.stdout.splitlines()
            if line.startswith(("plain (", "accumulate (", "keras builtin ("))
        }
        self.assertEqual(int(rows["accumulate (B=2, N=3)"][-3]), 4)
        self.assertEqual(int(rows["plain (B=6)"][-3]), 4)
        self.assertEqual(int(rows["plain (B=2)"][-3]), 12)
        self.assertGreater(float(rows["keras builtin (B=2, N=3)"][-1]), 1e-4)


class NoiseScaleExampleTest(tf.test.TestCase):
    def test_prints_the_table_for_every_run(self):
        result = _run_example(
            "noise_scale.py",
            "--epochs=2",
            "--epoch_samples=512",
            "--large_steps=8",
            "--width=8",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        lines = result.stdout.splitlines()
        epochs = [line for line in lines if line[:5].strip() in ("1", "2")]
        self.assertLen(epochs, 2)
        for line in epochs:
            # val_loss and B_simple for 3 runs, and the warm-up's N.
            cells = line.split()
            self.assertLen(cells, 1 + 3 * 2 + 1)
            # Every run measured every epoch: a NaN (no estimate) or inf
            # would still fill the table.
            for cell in cells[1:-1]:
                self.assertTrue(math.isfinite(float(cell)), line)
        for run in ("small", "large", "warmup"):
            self.assertTrue(
                any(line.startswith(run + " ") for line in lines), run
            )


class AdaScaleExampleTest(tf.test.TestCase):
    def test_prints_every_run_and_adascale_reaches_the_base_tau(self):
        base_updates, scales = 64, (2, 4)
        result = _run_example(
            "adascale.py",
            f"--base_updates={base_updates}",
            "--scales=" + ",".join(str(n) for n in scales),
            "--eval_samples=256",
            "--width=8",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        rows = {}
        for line in result.stdout.splitlines():
            name = line[:14].strip()
            if name == "base" or name.startswith(("linear x", "adascale x")):
                rows[name] = line[14:].split()
        self.assertLen(rows, 1 + 2 * len(scales))
        base_samples = base_updates * 16
        self.assertEqual(int(rows["base"][-3]), base_updates)
        self.assertEqual(int(rows["base"][-2]), base_samples)
        for n in scales:
            linear, ada = rows[f"linear x{n}"], rows[f"adascale x{n}"]
            # Linear scaling: the base's samples in N times fewer updates.
            self.assertEqual(int(linear[-3]), base_updates // n)
            self.assertEqual(int(linear[-2]), base_samples)
            updates, samples, gain = int(ada[-4]), int(ada[-3]), float(ada[-2])
            self.assertEqual(samples, updates * 16 * n)
            self.assertBetween(gain, 1.0, n)
            # It stopped at the first update that took tau (updates times
            # the mean gain, printed to 0.01) to the base's update count;
            # that update's gain was at most N.
            tau, rounding = updates * gain, updates * 0.005
            self.assertGreaterEqual(tau, base_updates - rounding)
            self.assertLess(tau, base_updates + n + rounding)


if __name__ == "__main__":
    tf.test.main()


class FitAnyBatchExampleTest(tf.test.TestCase):
    def test_auto_trains_as_the_batch_under_a_limit(self):
        # The reference without a limit, and "auto" under one: each
        # out-of-memory error costs about 10 s of the allocator's waiting.
        result = _run_example(
            "fit_any_batch.py",
            "--runs=auto",
            "--samples=512",
            "--epochs=1",
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        rows = {
            line[:24].strip(): line.split()
            for line in result.stdout.splitlines()
            if line.endswith("MiB")
        }
        auto = rows['micro_batch_size="auto"']
        # Under the limit it chose a slice smaller than the batch, made
        # the batch's two updates and ended on its weights.
        self.assertLess(int(auto[4]), 256)
        self.assertEqual(int(auto[5]), 2)
        self.assertLess(float(auto[7]), 1e-5)
        self.assertIn('micro_batch_size="auto" chose', result.stdout)
