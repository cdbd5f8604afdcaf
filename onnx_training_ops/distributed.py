"""Data-parallel training across processes and machines on ``torch.distributed`` (gloo).

Every rank holds the whole training model in a :class:`~onnx_training_ops.TrainingSession`.
A step is: ``backward`` on the rank's shard of the batch in onnxruntime (gradients add into
the session's flat accumulator buffers), an all-reduce that averages those buffers in place
(``torch.from_numpy`` shares their memory: no copy; the buffers are cut into buckets of
``bucket_bytes`` that are all in flight at once), then ``optimizer_step`` with the fused
in-place kernels, the same on every rank. So parameters stay identical across ranks;
:meth:`DistributedTrainingSession.check_parameters` proves it with a hash.

Gradient accumulation (several ``backward`` calls, one ``optimizer_step``) reduces once per
optimizer step, like DDP's ``no_sync``; schedules, clipping and the optimizers come from the
wrapped session. Launch with ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR, ...).

torch is an optional dependency (``pip install 'onnx-training-ops[distributed]'``); the core
package never imports this module.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import TrainingOpError

if TYPE_CHECKING:
    from .training.session import TrainingSession

__all__ = ["DistributedTrainingSession", "DivergedError", "INSTALL_HINT", "init_process_group",
           "destroy_process_group"]

INSTALL_HINT = "distributed training needs torch: pip install 'onnx-training-ops[distributed]'"
BUCKET_BYTES = 25 * 2**20  # as DDP's bucket_cap_mb


class DivergedError(TrainingOpError):
    """The ranks' states differ (a rank was fed other state, or a non-deterministic kernel)."""


def _dist():
    """``torch.distributed``, or an ImportError carrying the install hint (no traceback chain)."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return dist


def init_process_group(backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT); a no-op when already joined. ``timeout_s`` bounds every collective, so a
    rank that hangs ends the job instead of blocking it forever."""
    dist = _dist()
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0":
        dist.init_process_group(backend, timeout=timeout)
        return
    # a restart under torchrun --max-restarts: keys of the failed attempt may linger in the
    # job's store, so this attempt's processes meet under a prefix of their own
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"restart{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


def destroy_process_group() -> None:
    """Leave the job (call once at the end: a process that exits still joined can abort in
    gloo's threads, "terminate called without an active exception")."""
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()


class DistributedTrainingSession:
    """A TrainingSession trained data-parallel: same model on every rank, averaged gradients.

    ``session``: this rank's session (same model on every rank; rank 0's state is broadcast
    at construction, as DDP does). ``group``: a ``torch.distributed`` process group (default:
    the world). ``check_every``: verify every N optimizer steps that the ranks' states hash
    alike (0: never). ``bucket_bytes``: the size of one all-reduce.
    """

    def __init__(self, session: "TrainingSession", *, group=None, check_every: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 broadcast: bool = True) -> None:
        self._dist = _dist()
        if not self._dist.is_initialized():
            raise TrainingOpError("DistributedTrainingSession: torch.distributed is not initialized; "
                                  "call onnx_training_ops.distributed.init_process_group() under torchrun")
        self.session = session
        self.group = group
        self.check_every = int(check_every)
        self.bucket_bytes = int(bucket_bytes)
        self.rank = self._dist.get_rank(group)
        self.world_size = self._dist.get_world_size(group)
        self.steps = 0
        self.skipped_steps = 0
        self._skipped_at_step = session.skipped_steps
        if broadcast:
            self.broadcast_state()

    # ------------------------------------------------------------------ collectives

    def _collective(self, what: str, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:  # gloo: a peer closed the connection or timed out
            raise TrainingOpError(
                f"{what} failed on rank {self.rank} of {self.world_size}: another worker died or "
                f"the network failed ({str(error).splitlines()[0] if str(error) else error!r})") from None

    def _buckets(self, buffer: np.ndarray) -> list[np.ndarray]:
        per = max(1, self.bucket_bytes // buffer.itemsize)
        return [buffer[i:i + per] for i in range(0, buffer.size, per)]

    def all_reduce_gradients(self) -> None:
        """Average the accumulated gradients over the ranks, in place, bucket by bucket (all
        buckets in flight at once)."""
        import torch

        if self.world_size == 1:
            return
        buffers = self.session.gradient_buffers()
        pending = []
        for buffer in buffers:
            for bucket in self._buckets(buffer):
                pending.append(self._collective("all-reduce", self._dist.all_reduce, torch.from_numpy(bucket),
                                                group=self.group, async_op=True))
        for work in pending:
            self._collective("all-reduce", work.wait)
        scale = 1.0 / self.world_size
        for buffer in buffers:
            buffer *= buffer.dtype.type(scale)

    def broadcast_state(self, src: int = 0) -> None:
        """Copy rank ``src``'s state (parameters, optimizer state, schedule position) to every rank."""
        import torch

        state = self.session.state_dict()
        for name in sorted(state):
            array = np.require(state[name], requirements="C")
            self._collective("broadcast", self._dist.broadcast, torch.from_numpy(array), src, group=self.group)
            state[name] = array
        self.session.load_state_dict(state)
        position = torch.tensor([self.session.lr_schedule_step], dtype=torch.int64)
        self._collective("broadcast", self._dist.broadcast, position, src, group=self.group)
        if self.session.lr_schedule is not None:
            self.session.set_lr_schedule(self.session.lr_schedule, int(position.item()))

    def _any_skipped(self) -> bool:
        """Whether a rank skipped a batch (non-finite loss) since the last optimizer step."""
        import torch

        flag = torch.tensor([int(self.session.skipped_steps != self._skipped_at_step)], dtype=torch.int64)
        self._collective("all-reduce", self._dist.all_reduce, flag, group=self.group)
        return bool(flag.item())

    # ------------------------------------------------------------------ the training loop

    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """This rank's gradients on its shard (``TrainingSession.backward``); no communication."""
        return self.session.backward(feeds, scale)

    def optimizer_step(self, lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """Average the accumulated gradients over the ranks, then apply the optimizer on every
        rank. With ``on_nonfinite="skip"`` a batch skipped on any rank skips the step on all."""
        if self.session.on_nonfinite == "skip" and self._any_skipped():
            self.session.zero_grad()
            self._skipped_at_step = self.session.skipped_steps
            self.skipped_steps += 1
            return {}
        self.all_reduce_gradients()
        result = self.session.optimizer_step(lr)
        self.steps += 1
        if self.check_every and self.steps % self.check_every == 0:
            self.check_parameters()
        return result

    def step(self, feeds: Mapping[str, Any], lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """``backward(feeds)`` then :meth:`optimizer_step`: one step on the global batch made of
        every rank's ``feeds`` (equal shards give the full batch's mean loss). Returns this
        rank's loss; :meth:`average` gives the global one."""
        result = self.backward(feeds)
        result.update(self.optimizer_step(lr))
        return result

    def average(self, value: float) -> float:
        """The mean of ``value`` over the ranks (a loss or a metric)."""
        import torch

        tensor = torch.tensor([float(value)], dtype=torch.float64)
        self._collective("all-reduce", self._dist.all_reduce, tensor, group=self.group)
        return float(tensor.item()) / self.world_size

    # ------------------------------------------------------------------ consistency, checkpoints

    def state_digest(self) -> str:
        """SHA-256 of the state (every state variable, by name) and the schedule position."""
        digest = hashlib.sha256()
        for name, value in sorted(self.session.state_dict().items()):
            digest.update(name.encode())
            digest.update(value.tobytes())
        digest.update(str(self.session.lr_schedule_step).encode())
        return digest.hexdigest()

    def check_parameters(self) -> str:
        """Raise :class:`DivergedError` unless every rank's :meth:`state_digest` is the same;
        returns the digest."""
        mine = self.state_digest()
        digests: list[Any] = [None] * self.world_size
        self._collective("all-gather", self._dist.all_gather_object, digests, mine, group=self.group)
        if len(set(digests)) != 1:
            raise DivergedError(f"the ranks' states differ after {self.steps} steps: "
                                + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
        return mine

    def save(self, path: str | os.PathLike) -> str:
        """Rank 0 writes the checkpoint atomically (``TrainingSession.save``); every rank waits
        for it, so any rank can resume from ``path`` afterwards (``TrainingSession(path)``)."""
        if self.rank == 0:
            path = self.session.save(path)
        self._collective("barrier", self._dist.barrier, group=self.group)
        return os.fspath(path)
