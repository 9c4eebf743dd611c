"""Agreement among ranks while saving or loading: every rank learns of any rank's failure before anyone
raises, so no rank waits forever in a later collective."""
from __future__ import annotations

from ..comm import DataParallel
from .format import CheckpointError


def agree(dp: DataParallel, error: BaseException | None, what: str) -> None:
    """Every rank raises if any rank failed (its own error, or one naming the ranks that failed), so no rank
    waits forever in a later collective for a rank that gave up."""
    failures = dp.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): {detail}")
