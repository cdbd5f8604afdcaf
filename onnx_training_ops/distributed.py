"""Data-parallel training across processes and machines on ``torch.distributed``.

Every rank holds the whole training model in a :class:`~onnx_training_ops.TrainingSession`,
whatever its engine: host arrays with the fused kernels (the default), or the update in the
graph with the state in host arrays (``device="cpu"``) or on a GPU (``device="cuda:N"``). A
step is: ``backward`` on the rank's shard of the batch in onnxruntime (gradients add into the
session's flat accumulator buffers, one per dtype), an all-reduce that averages those buffers
in place, then ``optimizer_step``, the same on every rank. The buffers reach torch without a
copy: ``torch.from_numpy`` on host arrays, DLPack (``torch.from_dlpack`` of onnxruntime's
OrtValue) on a device; they are cut into buckets of ``bucket_bytes`` that are all in flight
at once. gloo reduces CPU tensors, NCCL CUDA ones (:func:`init_process_group` joins with both
where CUDA is available). Parameters stay identical across ranks;
:meth:`DistributedTrainingSession.check_parameters` proves it with a hash.

Gradient accumulation (several ``backward`` calls, one ``optimizer_step``) reduces once per
optimizer step, like DDP's ``no_sync``; schedules, clipping and the optimizers come from the
wrapped session. Launch with ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...).

``shard_optimizer_state=True`` is ZeRO stage 1 (torch's ``ZeroRedundancyOptimizer``): each
trainable belongs to one rank (:func:`~onnx_training_ops.training.state.shard.partition`), which
alone holds its optimizer state and updates it; gradients are reduced to their owner
(reduce-scatter; an all-reduce when global-norm clipping needs every gradient on every rank)
and each owner broadcasts its updated parameters (all-gather). V/H memory per rank is about
1 / world; results equal the unsharded path (same gradients, same kernels).

The all-reduce does not overlap the backward pass: a rank's gradients come out of one
onnxruntime run, which returns when the last one is ready (docs/distributed.md says what a
split backward would cost and what it could win, measured).

torch is an optional dependency (``pip install 'onnx-training-ops[distributed]'``); the core
package never imports this module.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .builder.metadata import TrainingMetadata
from .errors import TrainingOpError
from .storage.model_files import as_model, load_model
from .storage.snapshot import write_state
from .storage.tensors import proto_of
from .training.session.session import TrainingSession
from .training.state.fingerprint import differences, fingerprint
from .training.state.shard import optimizer_state, partition, shard_model, skeleton

if TYPE_CHECKING:
    from .storage.model_files import ModelLike

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


def init_process_group(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT); a no-op when already joined. ``backend``: None joins with gloo for CPU
    tensors and, where CUDA is available, NCCL for CUDA ones (``"cpu:gloo,cuda:nccl"``: host
    and GPU sessions both work; NCCL starts only when a CUDA tensor is reduced); or any
    ``torch.distributed`` backend string. ``timeout_s`` bounds every collective, so a rank that
    hangs ends the job instead of blocking it forever."""
    dist = _dist()
    if dist.is_initialized():
        return
    if backend is None:
        import torch

        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
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

    ``session``: this rank's :class:`TrainingSession` (any engine: host arrays, ``device="cpu"``,
    ``device="cuda:N"``), or the training model (ModelProto, path or bytes) to open one with
    ``session_kwargs`` (same model on every rank; rank 0's state is broadcast at construction,
    as DDP does). ``shard_optimizer_state``: ZeRO stage 1 (see the module docstring; a session
    given is reopened on this rank's shard of its model, on its device). ``group``: a
    ``torch.distributed`` process group (default: the world) whose backend reduces tensors
    where the session keeps its state (gloo: the CPU; NCCL: CUDA). ``check_every``: verify
    every N optimizer steps that the ranks' states hash alike (0: never). ``bucket_bytes``:
    the size of one all-reduce.
    """

    def __init__(self, session: TrainingSession | ModelLike, *, shard_optimizer_state: bool = False, group=None,
                 check_every: int = 0, bucket_bytes: int = BUCKET_BYTES, broadcast: bool = True,
                 **session_kwargs: Any) -> None:
        self._dist = _dist()
        if not self._dist.is_initialized():
            raise TrainingOpError("DistributedTrainingSession: torch.distributed is not initialized; "
                                  "call onnx_training_ops.distributed.init_process_group() under torchrun")
        self.group = group
        self.check_every = int(check_every)
        self.bucket_bytes = int(bucket_bytes)
        self.rank = self._dist.get_rank(group)
        self.world_size = self._dist.get_world_size(group)
        self.sharded = bool(shard_optimizer_state)
        self._owners: dict[str, int] = {}
        self._optimizer_state: set[str] = set()
        self._reduce_runs: list[tuple[int, Any]] | None = None  # (owner, torch slice): at the first reduction
        if isinstance(session, TrainingSession) and session_kwargs:
            raise TrainingOpError(f"DistributedTrainingSession: {sorted(session_kwargs)} apply only when a "
                                  "model is given, not a TrainingSession")
        if self.sharded:
            session = self._open_shard(session, session_kwargs)
        else:
            if not isinstance(session, TrainingSession):
                session = TrainingSession(session, **session_kwargs)
            self._fingerprint = fingerprint(proto_of(session._store.model))
        self.session = session
        self._tensors: dict[int, tuple[Any, Any]] = {}  # id(exported buffer) -> (it, its torch tensor)
        self._device, self._wire = self._devices()
        self._check_same_model()
        self._rate_names = sorted({name for names in self._gather(session.learning_rate_names) for name in names})
        self.steps = 0
        self.skipped_steps = 0
        self._skipped_at_step = session.skipped_steps
        if broadcast:
            self.broadcast_state()

    def _open_shard(self, source, session_kwargs) -> TrainingSession:
        """This rank's session on its shard of the model (rank 0 keeps the model's skeleton,
        without state values, to write whole checkpoints)."""
        # every tensor in the message, whatever the size (the shards are built from it)
        model = proto_of(load_model(source.training_model() if isinstance(source, TrainingSession) else source))
        self._fingerprint = fingerprint(model)  # of the whole model: every rank's shard differs
        per_param = optimizer_state(model)
        self._owners = partition(model, self.world_size)
        self._optimizer_state = {s for states in per_param.values() for s in states}
        self._per_param = per_param
        self._all_gradients = TrainingMetadata.from_model(model).grad_norm is not None  # clipping reads every gradient
        shard = shard_model(model, self._owners, self.rank, self.world_size)
        self._skeleton = skeleton(model) if self.rank == 0 else None
        del model
        if isinstance(source, TrainingSession):
            return source.with_model(shard)
        return TrainingSession(shard, **session_kwargs)

    def _devices(self):
        """(where the state's tensors are, where scalars and point-to-point copies travel) as
        torch devices, after checking that the group's backend reduces tensors there; a CUDA
        state's device becomes torch's current one (NCCL's object collectives use it)."""
        import torch

        first = self.session.state_names[:1]
        device = self._shared(self.session.state_tensors(first)[0]).device if first else torch.device("cpu")
        backend = str(self._dist.get_backend(self.group)).lower()
        if ":" in backend:  # "cpu:gloo,cuda:nccl"
            supported = {pair.split(":")[0] for pair in backend.split(",")}
        else:
            supported = set(self._dist.Backend.backend_capability.get(backend, ["cpu", "cuda"]))
        if device.type not in supported:
            hint = ("init_process_group('nccl') (or 'cpu:gloo,cuda:nccl', the default where CUDA is available)"
                    if device.type == "cuda" else "init_process_group('gloo')")
            raise TrainingOpError(
                f"DistributedTrainingSession: the session keeps its state on {device}, but the process group's "
                f"backend {backend!r} reduces {sorted(supported)} tensors only: {hint}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device, torch.device("cpu") if "cpu" in supported else device

    def _shared(self, buffer: Any):
        """A torch tensor over ``buffer``'s memory, no copy: ``torch.from_numpy`` of a host array,
        ``torch.from_dlpack`` of an OrtValue (made once per buffer)."""
        import torch

        found = self._tensors.get(id(buffer))
        if found is None or found[0] is not buffer:
            tensor = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else torch.from_dlpack(buffer)
            found = self._tensors[id(buffer)] = (buffer, tensor)
        return found[1]

    def _state(self, names: Sequence[str]) -> list[Any]:
        """Torch tensors over the live state variables ``names``."""
        return [self._shared(buffer) for buffer in self.session.state_tensors(names)]

    def _settle(self) -> None:
        """Wait for the collectives' device work (onnxruntime's next run reads the buffers on its
        own stream; its own runs are finished when they return)."""
        if self._device.type == "cuda":
            import torch

            torch.cuda.current_stream(self._device).synchronize()

    def _run_all(self, what: str, call, tensors, *args, **kwargs) -> None:
        """``call(tensor, *args, async_op=True)`` for every tensor, all in flight, then waited for."""
        pending = [self._collective(what, call, tensor, *args, group=self.group, async_op=True, **kwargs)
                   for tensor in tensors]
        for work in pending:
            self._collective(what, work.wait)
        self._settle()

    @property
    def owners(self) -> dict[str, int]:
        """With ``shard_optimizer_state``: trainable -> the rank that holds its optimizer state."""
        return dict(self._owners)

    # ------------------------------------------------------------------ collectives

    def _collective(self, what: str, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:  # gloo: a peer closed the connection or timed out
            raise TrainingOpError(
                f"{what} failed on rank {self.rank} of {self.world_size}: another worker died or "
                f"the network failed ({str(error).splitlines()[0] if str(error) else error!r})") from None

    def _check_same_model(self) -> None:
        """Raise TrainingOpError on every rank unless all ranks opened the same training model
        (graph, loss, optimizer, state names and shapes; state values may differ). Without
        this, another model on one rank ends in gloo's SIGABRT or trains on unnoticed."""
        prints = self._gather(self._fingerprint)
        odd = {rank: differences(p, prints[0]) for rank, p in enumerate(prints) if p != prints[0]}
        if odd:
            raise TrainingOpError(
                "DistributedTrainingSession: the ranks opened different training models; "
                + "; ".join(f"rank {rank} differs from rank 0 in {', '.join(parts)}" for rank, parts in odd.items())
                + ". Every rank must build or load the same model (state values may differ: rank 0's are "
                "broadcast)")

    def _buckets(self, tensor) -> list:
        per = max(1, self.bucket_bytes // tensor.element_size())
        return [tensor[i:i + per] for i in range(0, tensor.numel(), per)]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def _gather(self, value: Any) -> list[Any]:
        values: list[Any] = [None] * self.world_size
        self._collective("all-gather", self._dist.all_gather_object, values, value, group=self.group)
        return values

    def all_reduce_gradients(self) -> None:
        """Average the accumulated gradients over the ranks, in place, bucket by bucket (all
        buckets in flight at once). Sharded: each gradient is averaged on its owner only
        (reduce), unless global-norm clipping needs them all."""
        scale = 1.0 / self.world_size
        if self.sharded and not self._all_gradients:
            if self._reduce_runs is None:  # the accumulators keep their place: one plan serves every step
                buffers = [self._shared(b) for b in self.session.gradient_tensors()]
                runs = _runs(self.session.gradient_layout(), self._owners)
                self._reduce_runs = [(owner, buffers[index][start:stop]) for owner, index, start, stop in runs]
            pending = [self._collective("reduce", self._dist.reduce, bucket, self._global(owner), group=self.group,
                                        async_op=True)
                       for owner, run in self._reduce_runs for bucket in self._buckets(run)]
            for work in pending:
                self._collective("reduce", work.wait)
            for owner, run in self._reduce_runs:
                if owner == self.rank:
                    run.mul_(scale)
            self._settle()
            return
        buffers = [self._shared(b) for b in self.session.gradient_tensors()]
        self._run_all("all-reduce", self._dist.all_reduce, [bucket for b in buffers for bucket in self._buckets(b)])
        for buffer in buffers:
            buffer.mul_(scale)
        self._settle()

    def _all_gather_parameters(self) -> None:
        """Sharded: each owner broadcasts its updated parameters (one broadcast per tensor,
        all in flight at once, as ZeroRedundancyOptimizer does)."""
        names = list(self._owners)
        pending = [self._collective("all-gather", self._dist.broadcast, tensor, self._global(self._owners[name]),
                                    group=self.group, async_op=True)
                   for name, tensor in zip(names, self._state(names))]
        for work in pending:
            self._collective("all-gather", work.wait)
        self._settle()

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm running statistics) to every rank, as DDP's
        ``broadcast_buffers`` does: each rank's come from its own shard of the batch."""
        names = self.session.buffer_names
        if names:
            self._run_all("broadcast", self._dist.broadcast, self._state(names), self._global(0))

    def _replicated(self) -> list[str]:
        """State every rank holds alike: all of it, or all but the optimizer state when sharded."""
        return [n for n in sorted(self.session.state_names) if n not in self._optimizer_state]

    def broadcast_state(self, src: int = 0) -> None:
        """Copy rank ``src``'s state (parameters, optimizer state unless sharded, schedule
        position) to every rank."""
        import torch

        self._run_all("broadcast", self._dist.broadcast, self._state(self._replicated()), self._global(src))
        position = torch.tensor([self.session.lr_schedule_step], dtype=torch.int64, device=self._wire)
        self._collective("broadcast", self._dist.broadcast, position, self._global(src), group=self.group)
        if self.session.lr_schedule is not None:
            self.session.set_lr_schedule(self.session.lr_schedule, int(position.item()))

    def _any_skipped(self) -> bool:
        """Whether a rank skipped a batch (non-finite loss) since the last optimizer step."""
        import torch

        flag = torch.tensor([int(self.session.skipped_steps != self._skipped_at_step)], dtype=torch.int64,
                            device=self._wire)
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
        result = self.session.optimizer_step(self._own_rates(lr))
        if self.sharded:
            self._all_gather_parameters()
        self._broadcast_buffers()
        self.steps += 1
        if self.check_every and self.steps % self.check_every == 0:
            self.check_parameters()
        return result

    def _own_rates(self, lr):
        """``lr`` checked against every rank's learning-rate inputs, narrowed to this rank's
        (a shard may update no tensor of some parameter group)."""
        if lr is None or not self.sharded:
            return lr
        own = set(self.session.learning_rate_names)
        if not isinstance(lr, Mapping):
            return lr if own else None
        unknown = sorted(set(lr) - set(self._rate_names))
        if unknown:
            raise TrainingOpError(f"optimizer_step: lr names unknown learning-rate input(s) {unknown}; "
                                  f"the model's: {self._rate_names}")
        return {name: value for name, value in lr.items() if name in own}

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

        tensor = torch.tensor([float(value)], dtype=torch.float64, device=self._wire)
        self._collective("all-reduce", self._dist.all_reduce, tensor, group=self.group)
        return float(tensor.item()) / self.world_size

    # ------------------------------------------------------------------ consistency, checkpoints

    def state_digest(self) -> str:
        """SHA-256 of the state every rank holds alike (by name) and the schedule position."""
        digest = hashlib.sha256()
        names = self._replicated()
        for name, tensor in zip(names, self._state(names)):
            digest.update(name.encode())
            digest.update(tensor.contiguous().cpu().numpy().tobytes())
        digest.update(str(self.session.lr_schedule_step).encode())
        return digest.hexdigest()

    def check_parameters(self) -> str:
        """Raise :class:`DivergedError` unless every rank's :meth:`state_digest` is the same;
        returns the digest."""
        digests = self._gather(self.state_digest())
        if len(set(digests)) != 1:
            raise DivergedError(f"the ranks' states differ after {self.steps} steps: "
                                + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
        return digests[0]

    def full_state_dict(self) -> dict[str, np.ndarray] | None:
        """Every state variable (sharded: the owners send their optimizer state to rank 0);
        on rank 0, None elsewhere when sharded."""
        import torch

        state = self.session.state_dict()
        if not self.sharded:
            return state
        for param, owner in self._owners.items():
            if owner == 0:
                continue
            for name in self._per_param[param]:
                if self.rank == owner:
                    self._collective("send", self._dist.send, torch.from_numpy(state[name]).to(self._wire),
                                     self._global(0), group=self.group)
                elif self.rank == 0:
                    assert self._skeleton is not None  # rank 0 keeps it (_open_shard)
                    spec = self._skeleton[1][name]
                    tensor = torch.from_numpy(np.empty(spec[0], spec[1])).to(self._wire)
                    self._collective("recv", self._dist.recv, tensor, self._global(owner), group=self.group)
                    state[name] = tensor.cpu().numpy()
        return state if self.rank == 0 else None

    def save(self, path: str | os.PathLike) -> str:
        """Rank 0 writes the checkpoint atomically (the whole state, gathered when sharded);
        every rank waits for it, so any rank can resume from ``path`` afterwards
        (``TrainingSession(path)``, or this class with the same ``shard_optimizer_state``)."""
        if not self.sharded:
            if self.rank == 0:
                path = self.session.save(path)
        else:
            state = self.full_state_dict()
            if self.rank == 0:
                assert self._skeleton is not None and state is not None  # rank 0 keeps and gathers them
                model = write_state(as_model(self._skeleton[0], copy=False), state,
                                    self.session.checkpoint_metadata())
                path = model.write(path, checksums=True)
        self._collective("barrier", self._dist.barrier, group=self.group)
        return os.fspath(path)


def _runs(layout: Sequence[tuple[str, int, int, tuple[int, ...]]],
          owners: Mapping[str, int]) -> list[tuple[int, int, int, int]]:
    """(owner, buffer index, start, stop): element ranges of the flat gradient buffers, each
    gradient's (``TrainingSession.gradient_layout``) merged with the one before when they lie
    back to back in one buffer and have one owner (the layout is the same on every rank)."""
    runs: list[tuple[int, int, int, int]] = []
    for param, index, offset, shape in layout:
        owner, stop = owners[param], offset + int(np.prod(shape, dtype=np.int64))
        if runs and runs[-1][:2] == (owner, index) and runs[-1][3] == offset:
            runs[-1] = (owner, index, runs[-1][2], stop)
        else:
            runs.append((owner, index, offset, stop))
    return runs
