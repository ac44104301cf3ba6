"""Optimizers for sharded and offloaded training: a fused CPU AdamW (`AdamW`, and
`adamw_step` for one flat bucket at a time) in the C++ extension, with the torch reference it
is tested against. Imports only `overlap.kernels` (to load the extension), so the runtime may
use it."""
from .adamw import AdamW
from .flat_step import OPTIM_BACKENDS, ExtensionUnavailable, adamw_step, extension_available, kernel_covers

__all__ = ["AdamW", "OPTIM_BACKENDS", "ExtensionUnavailable", "adamw_step", "extension_available", "kernel_covers"]
