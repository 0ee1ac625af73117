"""The experimental build options switched on by an environment variable at build
(kernels/pdl.py's PAGECAST_PDL): how the value reads, and the check that the GPU has what the option needs."""

from __future__ import annotations

import os
from typing import Any


def flag(env: str, strict: bool = True) -> bool:
    """Whether ``env`` asks for the option (1, true, yes, on); ``strict``: a value other than those
    and 0 (false, no, off, unset) is an error, else it reads as off."""
    value = os.environ.get(env, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if strict and value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"{env} must be 1 or 0, got {value!r}")
    return False


class Option:
    """One experimental build option: the variable that asks for it at build, what it is (for the
    error on an older GPU), and whether it is on in this process (``on``: the build's from the
    variable; serving's from the artifact's tuning table, through ops.configure)."""

    def __init__(self, env: str, feature: str):
        self.env, self.feature = env, feature
        self.on = flag(env, strict=False)

    def requested(self, strict: bool = True) -> bool:
        return flag(self.env, strict)

    def enabled(self) -> bool:
        return self.on

    def set_enabled(self, on: bool) -> None:
        self.on = bool(on)

    def check_device(self, device: Any = "cuda") -> None:
        require_sm90(self.env, self.feature, device)


def require_sm90(env: str, feature: str, device: Any = "cuda") -> None:
    """Refuse ``feature`` (asked for by ``env``) on a GPU before sm_90."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(
            f"{env}=1: {feature} needs an sm_90 or newer GPU, this one is sm_{major}{minor}; build without {env}"
        )
