"""Recovery without restarting the job: ``unickpt run`` (a launcher with warm spares, one per
node) and :func:`unickpt.recover` (the training function, run again in the same process after
another process failed). See docs/recovery.md."""

from .recover import Epoch, Recovery, current_epoch, recover

__all__ = ["Epoch", "Recovery", "current_epoch", "recover"]
