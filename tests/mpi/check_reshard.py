"""Run under mpiexec (4 ranks): a checkpoint written by 4 ranks resumed by 2, and one
written by 3 resumed by 2, for DDP-style averaging and ZeRO-1 (whose optimizer slices
are re-cut). As loaded, the parameters and the optimizer's state are the saved ones bit
for bit (nothing is computed: the slices are only put end to end and cut again); after
one step, the loss is within 1e-6 of the old rank count's own step and the parameters
within a relative 1e-6 (the gradient's sum is grouped by rank, so it rounds differently).
Without ``reshard=True`` the other rank count is refused, naming the manifest, on every
rank alike. Prints one line per case and "reshard OK".
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from harness import RANK, SIZE, WORLD, expect, verdict

from pcourse import resume
from pcourse.tools.bench import restart


def case(tmp: Path, old_p: int, new_p: int, strategy: str, lines: list[str]) -> None:
    root = str(tmp / f"{old_p}-{new_p}-{strategy}")
    outs = WORLD.allgather(restart.resharding(old_p, new_p, root, strategy))
    got = restart.resharded(outs)
    what = f"{strategy} {old_p} -> {new_p}"
    expect(got["params loaded"], f"{what}: the loaded parameters differ from the saved ones")
    expect(got["optimizer loaded"], f"{what}: the loaded optimizer state differs")
    expect(got["said"] == f"resumed from step-00000015 (written by {old_p} ranks, re-cut for "
           f"{new_p})", f"{what}: said {got['said']!r}")
    ref, new = got["loss"]
    # tolerance, not equality: the gradient's sum is grouped by rank, so it rounds differently
    expect(abs(ref - new) <= 1e-6, f"{what}: first loss {new} vs {ref}")
    expect(got["params rel diff"] <= 1e-6, f"{what}: params rel diff {got['params rel diff']}")
    lines.append(f"{what}: first loss differs by {abs(ref - new):.2g} (bitwise: "
                 f"{got['loss bitwise']}), params by {got['params rel diff']:.2g} relative")
    fewer = restart.first_ranks(new_p)
    if fewer is not None:  # without asking: refused, naming the manifest
        model, opt, sched = restart.build(fewer, strategy)
        try:
            resume.load(root, fewer, model, opt, sched)
            message = ""
        except resume.CheckpointError as exc:
            message = str(exc)
        expect(f"step-00000015/manifest.json: written by {old_p} ranks, this job has {new_p}"
               in message, f"{what} unasked: {message!r}")
        fewer.close()


def main() -> int:
    expect(SIZE >= 4, "run on 4 ranks")
    tmp = Path(WORLD.bcast(tempfile.mkdtemp(prefix="pcourse-reshard-") if RANK == 0 else None))
    lines: list[str] = []
    try:
        for old_p in (4, 3):
            for strategy in restart.STRATEGIES:
                case(tmp, old_p, 2, strategy, lines)
    finally:
        WORLD.Barrier()
        if RANK == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    code = verdict(f"reshard on {SIZE} ranks", "\n".join(lines) if RANK == 0 else "")
    if code == 0 and RANK == 0:
        print("reshard OK", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
