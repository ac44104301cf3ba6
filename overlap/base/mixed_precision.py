"""Mixed-precision policy: which dtype parameters are gathered in and gradients reduced in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Master shards keep the parameters' own dtype (fp32 in the usual case).

    param_dtype: dtype of the gathered full parameters that forward and backward compute with;
        floating-point forward inputs are cast to it. None keeps each parameter's dtype.
    reduce_dtype: dtype gradients are reduced in across ranks. None uses param_dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecision.{field}={value!r} is invalid; expected a floating-point torch.dtype")

    def gather_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        if not master_dtype.is_floating_point or self.param_dtype is None:
            return master_dtype
        return self.param_dtype

    def grad_reduce_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        if not master_dtype.is_floating_point:
            return master_dtype
        return self.reduce_dtype or self.param_dtype or master_dtype
