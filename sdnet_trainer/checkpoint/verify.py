"""Verifying a checkpoint's checksums before resuming from it, spread over the ranks: rank 0
decides which checkpoint to load, and every rank checks a share of its files (divided by size),
so no rank reads the whole checkpoint. Rank 0 sends each candidate's shares; the other ranks
check theirs and report back until rank 0 sends its decision (:class:`Decided`)."""

from __future__ import annotations

import dataclasses

from sdnet_trainer.checkpoint.files import Folder
from sdnet_trainer.checkpoint.group import CheckpointGroup
from sdnet_trainer.checkpoint.untrusted import Checkpoint, CheckpointError, checksum_error


@dataclasses.dataclass(frozen=True)
class Decided:
    """Rank 0's decision (after any number of checksum requests)."""

    outcome: Checkpoint | Exception | None


def divide(expected: dict[str, tuple[int, int]], parts: int) -> list[dict[str, int]]:
    """{name: crc32} for each of ``parts`` ranks to check: largest files first, each to the rank
    with the fewest bytes so far (ties: the lowest rank)."""
    shares: list[dict[str, int]] = [{} for _ in range(parts)]
    load = [0] * parts
    for name, (size, checksum) in sorted(expected.items(), key=lambda kv: (-kv[1][0], kv[0])):
        rank = min(range(parts), key=lambda r: (load[r], r))
        shares[rank][name] = checksum
        load[rank] += size
    return shares


def check_share(folder: Folder, share: dict[str, int]) -> str | None:
    """The first failure among this rank's share of the files, or None. Never raises: every rank
    must reach the gather that follows, or the others would wait there."""
    for name in sorted(share):
        try:
            error = checksum_error(folder, name, share[name])
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 as the file's failure
            error = f"cannot check {name}: {type(exc).__name__}: {exc}"
        if error is not None:
            return error
    return None


def check_on_every_rank(
    ranks: CheckpointGroup, folder: Folder, expected: dict[str, tuple[int, int]], world_size: int
) -> None:
    """Rank 0: the checksums of ``folder``'s files checked by every rank; a CheckpointError
    naming the first file that fails."""
    shares = divide(expected, world_size)
    ranks.from_rank0((folder, shares))
    reports = ranks.to_rank0(check_share(folder, shares[0]))
    assert reports is not None  # rank 0
    if failed := [report for report in reports if report is not None]:
        raise CheckpointError(failed[0])


def follow_rank0(ranks: CheckpointGroup, rank: int) -> Checkpoint | Exception | None:
    """Other ranks: check the shares rank 0 asks for until it sends its decision; the decision."""
    while not isinstance(request := ranks.from_rank0(None), Decided):
        folder, shares = request
        ranks.to_rank0(check_share(folder, shares[rank]))
    return request.outcome
