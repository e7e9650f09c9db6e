"""``tf.distribute.MultiWorkerMirroredStrategy`` across two worker processes on the CPU
(TF_CONFIG on localhost) for both Keras wrappers.

- The weights equal those of the big batch trained in this one process (1e-5 of max|w|).
- Communication: the all-reduces that ran are recorded, with their sizes, as they run (see
  tf_multiworker_worker.py). The gradients cross the workers once per cycle, as one packed
  all-reduce at the boundary — exactly what Keras's own step sends once per big batch — and
  nothing of their size in between; the only other all-reduce of the cycle is the boundary's
  one-element non-finite verdict (every worker skips the same cycles).
- The wrapper's ``global_clipnorm`` and AGC clip the cycle's gradient summed over the workers
  (the clipped big batch), with the same single gradient all-reduce per cycle.
- ``ModelCheckpoint`` written half-way through a cycle (two micro-batches accumulated on each
  worker) and loaded on both workers resumes that cycle: the run ends where the uninterrupted
  one does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from keras_helpers import BACKEND

if BACKEND != "tensorflow":
    pytest.skip("tf.distribute is TensorFlow's", allow_module_level=True)

import tf_multiworker_worker as worker  # noqa: E402

import gradient_accumulator  # noqa: E402

WORKERS = 2
TOL = 1e-5
GRADIENT_ELEMENTS = 6 * 8 + 8 + 8 * 3 + 3  # the model's parameters, all-reduced as one pack


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("multiworker")
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(WORKERS)]}
    package_root = str(Path(gradient_accumulator.__file__).resolve().parent.parent)
    procs = []
    for index in range(WORKERS):
        env = dict(os.environ)
        env.update(
            KERAS_BACKEND="tensorflow",
            TF_CPP_MIN_LOG_LEVEL="2",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
            PYTHONPATH=os.pathsep.join([package_root, env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
        )
        log = open(out / f"worker{index}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, worker.__file__, str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    try:
        # A worker that fails leaves the other waiting in a collective: stop it at once.
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc, _ in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.5)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    assert codes == [0] * WORKERS, "\n".join(
        f"worker {i} exited with {c}:\n{(out / f'worker{i}.log').read_text()[-3000:]}"
        for i, c in enumerate(codes)
    )
    return [json.loads((out / f"worker{i}.json").read_text()) for i in range(WORKERS)]


@pytest.fixture(scope="module")
def big_batch() -> np.ndarray:
    x, y = worker.data()
    model = worker.build("plain", 1)
    model.fit(
        x,
        y,
        batch_size=worker.ACCUM * worker.MICRO,
        epochs=worker.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return np.asarray(worker.flat(model))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_two_workers(results):
    assert [r["replicas"] for r in results] == [WORKERS] * WORKERS


@pytest.mark.parametrize("wrapper", worker.WRAPPERS)
def test_matches_the_big_batch_on_one_process(results, big_batch, wrapper):
    assert _rel(results[0]["plain"]["weights"], big_batch) <= TOL
    for r in results:
        assert _rel(r[wrapper]["weights"], big_batch) <= TOL
        # 64 samples, 2 epochs, 4 global micro-batches of 8 per update.
        assert r[wrapper]["iterations"] == 4
    np.testing.assert_array_equal(results[0][wrapper]["weights"], results[1][wrapper]["weights"])


@pytest.mark.parametrize("wrapper", worker.WRAPPERS)
def test_gradients_are_all_reduced_once_per_cycle(results, wrapper):
    for r in results:
        # Keras's big batch: one packed gradient all-reduce per step (the other all-reduces
        # are one-element logs), which shows the counter sees the strategy's reductions.
        plain = r["plain"]["all_reduces"]
        assert [[s for s in step if s > 1] for step in plain] == [[GRADIENT_ELEMENTS]] * 4
        steps = r[wrapper]["all_reduces"]
        assert len(steps) == 4 * worker.ACCUM
        for i, step in enumerate(steps):
            boundary = i % worker.ACCUM == worker.ACCUM - 1
            assert [s for s in step if s > 1] == ([GRADIENT_ELEMENTS] if boundary else []), i
        # The one-element all-reduces: a micro-step inside a cycle sends what a step of Keras's
        # sends besides the gradients (its logs); the boundary one more (the verdict).
        scalars = [len([s for s in step if s == 1]) for step in steps]
        for i in range(worker.ACCUM - 1, len(steps), worker.ACCUM):
            assert scalars[i - 1] == len([s for s in plain[1] if s == 1]), scalars
            assert scalars[i] == scalars[i - 1] + 1, scalars


@pytest.mark.parametrize("wrapper", worker.WRAPPERS)
def test_model_checkpoint_mid_cycle_resumes(results, big_batch, wrapper):
    for r in results:
        entry = r[wrapper]
        assert entry["pending_after_load"] == 2  # saved after micro-batch 6 of a cycle of 4
        assert entry["resumed_iterations"] == 4
        assert _rel(entry["resumed_weights"], entry["weights"]) <= 1e-6
        assert _rel(entry["resumed_weights"], big_batch) <= TOL


def _fit_big_batch(model) -> np.ndarray:
    x, y = worker.data()
    model.fit(
        x, y, batch_size=worker.ACCUM * worker.MICRO, epochs=worker.EPOCHS, shuffle=False, verbose=0
    )
    return np.asarray(worker.flat(model))


@pytest.mark.parametrize("name", ["clipped", "agc"])
def test_clipping_matches_the_clipped_big_batch(results, big_batch, name):
    """The wrapper's global_clipnorm against Keras's own on the big batch in one process; AGC
    against the wrapper's with one micro-batch per update (the big batch) in one process."""
    if name == "clipped":
        ref = _fit_big_batch(worker.build("plain", 1, global_clipnorm=worker.CLIPNORM))
    else:
        ref = _fit_big_batch(worker.build("optimizer", 1, use_agc=True))
    # The clipping changes the result, so matching it is not matching the unclipped run.
    assert _rel(ref, big_batch) > 100 * TOL
    for r in results:
        assert "error" not in r[name], r[name]["error"]
        assert _rel(r[name]["weights"], ref) <= TOL
    np.testing.assert_array_equal(results[0][name]["weights"], results[1][name]["weights"])


@pytest.mark.parametrize("name", ["clipped", "agc"])
def test_clipping_all_reduces_the_gradients_once_per_cycle(results, name):
    """Clipping needs the summed gradient: it is reduced at the boundary, once, and the inner
    optimizer does not sum it again."""
    for r in results:
        assert "error" not in r[name], r[name]["error"]
        steps = r[name]["all_reduces"]
        assert len(steps) == 4 * worker.ACCUM
        for i, step in enumerate(steps):
            boundary = i % worker.ACCUM == worker.ACCUM - 1
            assert [s for s in step if s > 1] == ([GRADIENT_ELEMENTS] if boundary else []), i
