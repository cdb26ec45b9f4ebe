"""KL coefficient controllers: fixed, adaptive (Ziegler et al. 2019), exponential.

Each holds `.beta`, takes `.update(current_kl, n_steps)` once per measurement, and
round-trips through `state_dict()` / `load_state_dict()` (plain floats, JSON-friendly).
`current_kl` is a host number; the caller converts its measured tensor when it logs it.
Controllers are registered by name (`fixed`, `adaptive`, `exp`) for the config layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from shardrl.algo.registry import Registry


class KLController(Protocol):
    """What every controller offers."""

    beta: float

    def update(self, current_kl: float, n_steps: int) -> float: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


_CONTROLLERS: Registry[Callable[..., Any]] = Registry("KL controller")


def get_kl_controller(name: str) -> Callable[..., KLController]:
    """The controller class registered as `name` (error listing the known names otherwise)."""
    return _CONTROLLERS.get(name)


def known_kl_controllers() -> list[str]:
    """Names of the registered KL controllers, sorted."""
    return _CONTROLLERS.names()


class _Controller:
    """State handling shared by the controllers: every constructor field is state."""

    _fields: tuple[str, ...] = ()
    beta: float

    def state_dict(self) -> dict[str, float]:
        """Constructor fields and the current beta."""
        return {name: float(getattr(self, name)) for name in ("beta", *self._fields)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore from `state_dict()`; a missing key raises KeyError."""
        for name in ("beta", *self._fields):
            setattr(self, name, float(state[name]))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items())
        return f"{type(self).__name__}({fields})"


@_CONTROLLERS.register("fixed")
class FixedKLController(_Controller):
    """Constant beta; `update` changes nothing."""

    def __init__(self, beta: float) -> None:
        self.beta = float(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Return the unchanged beta."""
        return self.beta


@_CONTROLLERS.register("adaptive")
class AdaptiveKLController(_Controller):
    """Ziegler et al. 2019: `e = clip(kl/target - 1, -0.2, 0.2)`, `beta *= 1 + e*n/horizon`."""

    _fields = ("target", "horizon")

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got {target}, {horizon}")
        self.beta, self.target, self.horizon = float(init_beta), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move beta toward keeping `current_kl` at the target; return the new beta."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_steps / self.horizon
        return self.beta


@_CONTROLLERS.register("exp")
class ExpKLController(_Controller):
    """Exponential rule: `beta *= exp((kl - target) / target * rate)`; `n_steps` unused.

    The exponent is clamped to +-20 so an absurd measurement cannot overflow.
    """

    _fields = ("target", "rate")

    def __init__(self, init_beta: float, target: float, rate: float) -> None:
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        self.beta, self.target, self.rate = float(init_beta), float(target), float(rate)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Multiply beta by exp of the relative KL error times the rate; return it."""
        exponent = (float(current_kl) - self.target) / self.target * self.rate
        self.beta *= math.exp(min(max(exponent, -20.0), 20.0))
        return self.beta
