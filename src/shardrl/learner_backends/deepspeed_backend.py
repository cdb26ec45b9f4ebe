"""The DeepSpeed ZeRO learner backend (stage 1/2/3, optional optimizer offload, bf16).

Every rank runs the same learner on the same batch (the learner broadcasts rank 0's choice
of shards); DeepSpeed averages the identical gradients and partitions the optimizer state,
the gradients (stage 2) and the parameters (stage 3) across ranks. Memory per rank falls
with the number of ranks; the arithmetic per rank does not.

On a machine without CUDA it runs with DeepSpeed's CPU accelerator and gloo. A process not
started by `torchrun` becomes a world of one. Checkpoints hold the full AdamW moments per
named parameter (`safe_get_full_optimizer_state`), so they do not depend on the number of
ranks or on the backend.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config.stages import DeepSpeedBackend
from ..models.heads import Critic
from .base import (
    MASTER,
    MOMENTS,
    STEP_KEY,
    CriticModule,
    Json,
    Loan,
    OptimSettings,
    PolicyModule,
    moment_key,
    trainable_parts,
)

NEVER_PRINT = 2**62
"""DeepSpeed's `steps_per_print`: the learner logs its own metrics."""


BUILD_LOCK_STALE_S = 900.0
"""A torch extension's build lock older than this was left by a process killed while it held
it: DeepSpeed builds an op in a minute or two, and every process that loads one takes the lock
for a moment, so a learner killed while starting (a crash, a stopped run) can leave it behind,
and every later load would wait for it for ever."""

log = logging.getLogger("shardrl.learn")


def extensions_root() -> Path:
    """Where torch builds and caches extension ops (DeepSpeed's among them)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


@contextmanager
def stale_build_locks_removed(root: Path, stale_s: float = BUILD_LOCK_STALE_S,
                              every_s: float = 10.0) -> Iterator[None]:
    """While the block loads ops, a thread removes any build lock under `root` (`<op>/lock`,
    or `<python>_<device>/<op>/lock`) older than `stale_s`, saying so, and says once when a
    lock has held the load up for a minute: a wait that would never end ends then."""

    def sweep(said: set[Path]) -> None:
        for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
            try:
                age = time.time() - lock.stat().st_mtime
            except OSError:
                continue  # released meanwhile
            if age > stale_s:
                lock.unlink(missing_ok=True)
                log.warning("removed %s, %.0f s old: a process building or loading that op "
                            "was killed while it held the lock", lock, age)
            elif age > 60 and lock not in said:
                said.add(lock)
                log.info("waiting for %s (%.0f s old): another process builds that op, or one "
                         "was killed while building it (removed once %.0f s old)", lock, age,
                         stale_s)

    stop, said = threading.Event(), set()

    def watch() -> None:
        sweep(said)
        while not stop.wait(every_s):
            sweep(said)

    thread = threading.Thread(target=watch, name="build-locks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVE_TIMEOUT = timedelta(days=30)
"""How long a rank waits in a collective: as long as a stage may run (`pipeline.
stage_timeout_s` at most). The followers wait in one for the leader's next plan, which comes
when the rollouts have made a batch: minutes or hours at a run's start (images pulled, an
inference engine loading) or on a slow step, where DeepSpeed's default (10 minutes) failed the
learner. A rank that dies is caught by `torchrun`, which stops the others."""


def init_distributed() -> None:
    """Join the `torchrun` world, or make a world of one; nccl on CUDA, gloo otherwise."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    deepspeed.init_distributed("nccl" if torch.cuda.is_available() else "gloo",
                               timeout=COLLECTIVE_TIMEOUT)


def ds_config(cfg: DeepSpeedBackend, grad_clip: float | None,
              param_persistence_threshold: int | None = None) -> dict:
    """The DeepSpeed JSON config of `cfg` (one micro-batch per step: the learner batches)."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip or 0.0,
        "zero_optimization": zero,
        # a non-finite gradient norm skips the step in bf16 too, as in fp32 and the torch backend
        "bf16": {"enabled": cfg.bf16, "check_grad_overflow": True},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": NEVER_PRINT,
        "wall_clock_breakdown": False,
    }


def _set_zero3_state(param: nn.Parameter, value: Tensor, slot: str | None) -> None:
    """This rank's part of a full optimizer-state tensor (`slot` None: the float32 master),
    for a ZeRO-3 parameter.

    `safe_set_full_optimizer_state` slices the unpadded value, so under ZeRO-3 it fails for
    a parameter whose size is not a multiple of the number of ranks (the last partition is
    padded); this pads the value to whole partitions first.
    """
    opt = param._z3_optimizer
    part, _ = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False,
                                                 optim_state_key=slot)
    size, rank = part.numel(), opt._get_param_partition_rank(param)
    padded = torch.zeros(size * dist.get_world_size(), dtype=part.dtype, device=part.device)
    padded[: value.numel()] = value.flatten()
    part.data.copy_(padded.narrow(0, size * rank, size))


class _Parts(nn.Module):
    """The trainable modules under one root, as DeepSpeed wants a single model."""

    def __init__(self, policy: PolicyModule, critic: CriticModule | None) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic


class DeepSpeedLearnerBackend:
    """`Backend` on a DeepSpeed engine. Call it on every rank, in the same order. Its state
    is gathered from the partitions, so it is never lent (`lends_state`).

    `param_persistence_threshold` overrides ZeRO-3's size below which parameters stay whole
    on every rank (tests set 0 so that even a tiny model is partitioned).
    """

    lends_state = False

    def __init__(self, lm: nn.Module, settings: OptimSettings, cfg: DeepSpeedBackend,
                 critic: Critic | None = None,
                 param_persistence_threshold: int | None = None) -> None:
        with stale_build_locks_removed(extensions_root()):  # DeepSpeed loads its ops here
            self._build(lm, settings, cfg, critic, param_persistence_threshold)

    def _build(self, lm: nn.Module, settings: OptimSettings, cfg: DeepSpeedBackend,
               critic: Critic | None, param_persistence_threshold: int | None) -> None:
        init_distributed()
        import deepspeed

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.policy = PolicyModule(lm)
        self.critic = CriticModule(critic) if critic is not None else None
        self.parts = trainable_parts(lm, critic)
        groups = settings.param_groups(self.parts)
        if cfg.offload_optimizer and torch.cuda.is_available():
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(groups, lr=settings.lr, betas=settings.betas,
                                   weight_decay=settings.weight_decay, adamw_mode=True)
        else:
            opt = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas,
                                    weight_decay=settings.weight_decay)
        config = ds_config(cfg, settings.grad_clip, param_persistence_threshold)
        root = _Parts(self.policy, self.critic)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=root, optimizer=opt, config=config, dist_init_required=False)
        self.zero3 = cfg.zero_stage == 3
        self.bf16 = cfg.bf16
        """The module trains in bfloat16; the float32 masters live in the optimizer's
        partitions alone, so the state carries them (`MASTER`)."""
        if self.zero3:  # the FP32 head reads the (tied) output weight inside PolicyModule.forward
            deepspeed.zero.register_external_parameter(self.policy,
                                                       lm.get_output_embeddings().weight)
        self.device = next(lm.parameters()).device

    def set_lr(self, part: str, lr: float) -> None:
        for group in self.optimizer.param_groups:
            if group["name"] == part:
                group["lr"] = lr

    def _all_ranks_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def step(self, loss: Tensor) -> tuple[bool, float]:
        if not self._all_ranks_true(bool(torch.isfinite(loss))):
            return False, math.nan
        self.engine.backward(loss)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = math.nan if norm is None else float(norm)
        return bool(self.engine.was_step_applied()), norm

    def gathered(self) -> AbstractContextManager[None]:
        if not self.zero3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()),
                                                 modifier_rank=None)

    # -- checkpoint state -------------------------------------------------------------------
    def _inner_states(self) -> list[dict]:
        """The AdamW state entries of the flat fp32 partitions this rank owns."""
        inner = self.optimizer.optimizer
        return [s for s in inner.state.values() if s]

    def _link_fragments(self) -> None:
        """Point every ZeRO-1/2 parameter's fragment at the optimizer state.

        DeepSpeed links them once, right after the first parameter group's first step, when
        the later groups (the critic's) have no state yet; the `safe_*_full_optimizer_state`
        calls then miss those groups. Linking again after the state exists fixes that.
        """
        if not self.zero3:
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def state_dict(self, copy: bool = True, everywhere: bool = True) -> dict[str, Tensor]:
        """Full tensors gathered from the partitions: always fresh ones, whatever `copy`.
        With bf16 the float32 masters too: the module's weights are their bfloat16 rounding,
        and a resume from those would lose every update smaller than bfloat16's step. Every
        rank takes part in each gather; with `everywhere=False` only rank 0 keeps what it
        gathers, one tensor at a time."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        states = self._inner_states()
        local_step = float(states[0]["step"]) if states else 0.0
        steps = torch.tensor([local_step], dtype=torch.float64, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # a rank may own no partition
        state: dict[str, Tensor] = {STEP_KEY: torch.tensor(float(steps.item()))}
        if steps.item() == 0:
            return state
        self._link_fragments()
        keep = everywhere or self.rank == 0
        for part, module in self.parts.items():
            for name, param in module.named_parameters():
                for slot in MOMENTS:
                    full = safe_get_full_optimizer_state(param, slot)
                    if keep:
                        state[moment_key(part, name, slot)] = full.detach().float().cpu().clone()
                if self.bf16:
                    master = safe_get_full_fp32_param(param)
                    if keep:
                        state[moment_key(part, name, MASTER)] = \
                            master.detach().float().cpu().clone()
        return state

    def lend(self) -> Loan:
        raise NotImplementedError("DeepSpeed gathers its state: it lends none (lends_state)")

    def _materialize_state(self) -> None:
        """Create the (lazily built) AdamW state with one step of zero gradients at lr 0."""
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        ids = torch.zeros((1, 2), dtype=torch.long)
        ones = torch.ones_like(ids)
        start = torch.ones(1, dtype=torch.long)
        loss = self.policy(ids, ones, start).logprobs.sum() * 0.0
        if self.critic is not None:
            loss = loss + self.critic(ids, ones, start).sum() * 0.0
        self.engine.backward(loss)
        self.engine.step()
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """The moments and step, and with bf16 the float32 masters when `state` has them (one
        from the torch backend, whose module holds its masters, has not: they came in with
        the weights)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        step = float(state[STEP_KEY])
        if step == 0:
            return
        if not self._all_ranks_true(bool(self._inner_states())):
            self._materialize_state()
        self._link_fragments()
        missing = []
        for part, module in self.parts.items():
            for name, param in module.named_parameters():
                for slot in MOMENTS:
                    key = moment_key(part, name, slot)
                    if key not in state:
                        missing.append(key)
                        continue
                    value = state[key].to(self.device)
                    if self.zero3:
                        _set_zero3_state(param, value, slot)
                    else:
                        safe_set_full_optimizer_state(param, value, slot)
                master = state.get(moment_key(part, name, MASTER)) if self.bf16 else None
                if master is not None:
                    if self.zero3:
                        _set_zero3_state(param, master.to(self.device), None)
                    else:
                        safe_set_full_fp32_param(param, master.to(self.device))
        if missing:
            raise KeyError(f"optimizer state lacks {len(missing)} entries, e.g. {missing[:3]}")
        for slots in self._inner_states():
            if torch.is_tensor(slots["step"]):
                slots["step"].fill_(step)
            else:
                slots["step"] = int(step)

    def broadcast_json(self, value: Json) -> Json:
        data = json.dumps(value).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return json.loads(bytes(buf.cpu().tolist()))
