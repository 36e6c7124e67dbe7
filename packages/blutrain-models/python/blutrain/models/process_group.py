"""The processes of one training run, as the training loop sees them.

The loop needs little from a distributed run: which process it is (rank), how many there are
(world size), whether it is the one that prints and writes (is_main: rank 0), a sum of one host
number over every process (validation loss, token counts), and a barrier (after rank 0 writes
a checkpoint). A distributed step (blutrain-dist's DDP / ZeRO) brings its own group through
`Step.process_group`; one process uses `SingleProcess`, where each of these is trivial.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ProcessGroup(ABC):
    """What the training loop asks of the processes of a run (see the module docstring)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's index, 0 <= rank < world_size."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many processes train together."""

    @property
    def is_main(self) -> bool:
        """Whether this process prints, logs, plots and writes checkpoints (rank 0)."""
        return self.rank == 0

    @abstractmethod
    def all_reduce(self, value: float, op: str = "sum") -> float:
        """`value` summed ("sum") or averaged ("mean") over every process; every process gets
        the result. A collective: every process must call it, in the same order."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every process has called it."""

    def device(self, requested: str) -> str:
        """The device this process trains on, given the resolved --device ("cpu", "cuda",
        "cuda:N"): a distributed group gives each process of a node its own GPU."""
        return requested


class SingleProcess(ProcessGroup):
    """One process: rank 0 of 1."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_reduce(self, value: float, op: str = "sum") -> float:
        if op not in ("sum", "mean"):
            raise ValueError(f"[all_reduce] op {op!r} is not one of sum, mean")
        return float(value)

    def barrier(self) -> None:
        pass

    def __repr__(self) -> str:
        return "SingleProcess()"
