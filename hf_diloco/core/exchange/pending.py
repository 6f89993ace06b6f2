"""A launched exchange and its result: `PendingExchange` (waited on with a timeout, its failure an `OuterSyncError`
that says what to do), `ExchangeResult`, and the one thread every exchange of an engine runs on, in launch order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch


@dataclass
class ExchangeResult:
    average: torch.Tensor  # fp32, same length as the launched vector
    residual: torch.Tensor | None  # what the first encode dropped (for error feedback)
    bytes_sent: int  # cross-worker wire bytes this rank handed to the network
    bytes_sent_intra_worker: int
    clipped: bool = False  # this rank's contribution was scaled down by robust aggregation
    # Robust aggregation: every contribution scaled down in this exchange (the same on every worker), as (the
    # worker's name, its norm / the lower median of the contributors' norms).
    outliers: tuple[tuple[str, float], ...] = ()
    choice: dict | None = None  # the adaptive setting this exchange used (step, rank, compression, reason)
    contributors: int | None = None  # with an `OuterGroup`: the workers whose pseudo-gradient the average holds
    scale: float = 1.0  # with a weighted `OuterGroup`: what this worker's Δ was multiplied by (C w_m / Σ w)
    fastest_step_seconds: float | None = None  # with a weighted `OuterGroup`: the members' fastest step (0: none)
    # What a low-rank exchange measured, for the adaptive policy's next choices (`OuterExchange.learn`): the link's
    # rate, and (codec name, bytes sent / `wire_bytes`) with entropy coding.
    link_bytes_per_second: float | None = None
    coded_share: tuple[str, float] | None = None


class OuterSyncError(RuntimeError):
    """An outer exchange failed or did not finish in time."""


class WorkersOutOfStepError(OuterSyncError):
    """The workers of an exchange launched it at different points of their schedules: their averages would mix
    pseudo-gradients of different rounds (or a tail would wait for a peer that never sends one)."""


def unmasked_collective_error(error: BaseException) -> BaseException:
    """The collective's own error. torch's logging wrapper of `dist.*` collectives, handling a failed collective on a
    group torch.distributed did not create (torchft's elastic groups), raises its own ValueError from `get_backend`,
    which would hide the gloo error that says what happened."""
    masked = isinstance(error, ValueError) and "is not initialized in the world group map" in str(error)
    return error.__context__ if masked and error.__context__ is not None else error


class PendingExchange:
    """A launched exchange. Holds its buffers (inside the closure of the future) until the work is done."""

    def __init__(self, future: Future, description: str, timeout_seconds: float):
        self._future = future
        self.description = description
        self.timeout_seconds = timeout_seconds

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> ExchangeResult:
        try:
            return self._future.result(timeout=self.timeout_seconds)
        except OuterSyncError:
            raise  # already says what happened and what to do (e.g. workers out of step)
        except TimeoutError as error:
            raise OuterSyncError(
                f"{self.description} did not finish within sync_timeout_seconds={self.timeout_seconds:g}s. A peer "
                "worker has probably died or its link is down; restart from the latest checkpoint."
            ) from error
        except Exception as error:
            raise self._failure(unmasked_collective_error(error)) from error

    def _failure(self, error: BaseException) -> OuterSyncError:
        if isinstance(error, RuntimeError):  # gloo: a peer closed the connection, or no answer within the timeout
            return OuterSyncError(
                f"{self.description} failed: {error}. A peer worker has probably died, stopped or lost its link "
                f"(collectives give up after sync_timeout_seconds={self.timeout_seconds:g}s); restart from the latest "
                "checkpoint."
            )
        return OuterSyncError(f"{self.description} failed: {error}")

    @classmethod
    def run_inline(
        cls, job: Callable[[], ExchangeResult], description: str, timeout_seconds: float
    ) -> PendingExchange:
        """Run `job` on this thread; its failure is raised by `wait()` as an `OuterSyncError`, like a background
        exchange's. A stalled peer cannot hold it past the gloo groups' timeout (`Topology.from_default_group`)."""
        future: Future = Future()
        try:
            future.set_result(job())
        except Exception as error:
            future.set_exception(error)
        return cls(future, description, timeout_seconds)

    @classmethod
    def completed(cls, result: ExchangeResult, description: str = "restored exchange") -> PendingExchange:
        future: Future = Future()
        future.set_result(result)
        return cls(future, description, timeout_seconds=0.0)


class SerialWorker:
    """One daemon thread running submitted jobs in order (a stuck collective must not block interpreter exit)."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], ExchangeResult]) -> Future:
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            try:
                future.set_result(job())
            except BaseException as error:  # noqa: B036 - handed to the waiting thread
                future.set_exception(error)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._jobs.put((None, None))
        self._thread.join(timeout)  # a finished thread before the process group goes away
