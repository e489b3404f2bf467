"""Run under mpiexec: a run interrupted and resumed from its checkpoint is the run never
interrupted, bit for bit; four resumes that each lose one thing are not; bad checkpoints
are refused on every rank alike, loading nothing.

For DDP-style averaging, ZeRO-1 and FSDP (lesson 10's: each rank saves its parameters'
slices and their Adam state), and the VAE: Franke's net for 24 steps uninterrupted, and the same
run dying at step 18 (checkpoints at 5, 10 and 15) then resumed. Its last checkpoint is torn
(as if it died writing it: rank p-1's file still the step before's, no manifest): the
checked loader skips it, saying so; the unchecked one takes it, and goes elsewhere,
as do resumes without the generators, the data's position or the optimizer's state.
Args: the backend (default mpi); then what to run, comma-separated, of ddp, zero1, fsdp,
vae and bad (default: ddp, zero1 and bad; fsdp's per-unit collectives and the VAE's
MNIST make those the slow set's).
Prints "resume OK on p ranks".
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from harness import RANK, SIZE, WORLD, expect, verdict

from pcourse import resume
from pcourse.backends import make_backend
from pcourse.tools.bench import restart


def exact(tmp: Path, backend, strategy: str, lines: list[str]) -> None:
    out = restart.exactness(backend, str(tmp / strategy), strategy)
    check_exact(out, strategy, lines)


def vae_exact(tmp: Path, backend, lines: list[str]) -> None:
    """The VAE, DDP-style: exact too. Its noise is a table of the epoch, not a draw of
    the global generators: a resume without them stays exact, one without the data's
    position does not."""
    out = restart.exactness(backend, str(tmp / "vae"), "ddp", config=restart.VAE_CONFIG)
    check_exact(out, "vae", lines, needs_generators=False)


def check_exact(out: dict, strategy: str, lines: list[str], needs_generators: bool = True
                ) -> None:
    same = out["resumed"]
    expect(same["params"] and same["optimizer"] and same["losses"],
           f"{strategy}: resumed != uninterrupted: {same}")
    expect(out["said"].startswith("resumed from step-00000010; skipped step-00000015: no "
                                  "manifest.json"), f"{strategy}: said {out['said']!r}")
    for name, wrong in out["controls"].items():
        broke = not (wrong["params"] and wrong["optimizer"] and wrong["losses"])
        diffs = WORLD.allgather((wrong["param_diff"], wrong["loss_diff"]))
        if name == "no generator state" and not needs_generators:
            expect(not broke, f"{strategy}: {name}: the resume was not exact")
            continue
        expect(broke, f"{strategy}: {name}: the resume was still exact")
        lines.append(f"{strategy} {name}: params differ by up to "
                     f"{max(d[0] for d in diffs):.3g}, losses by {max(d[1] for d in diffs):.3g}")


def refused(what: str, call, names: str) -> None:
    """``call()`` raises CheckpointError naming ``names`` on this rank, the same on all."""
    try:
        call()
        message = ""
    except resume.CheckpointError as exc:
        message = str(exc)
    messages = {m for m in WORLD.allgather(message) if m is not None}
    expect(names in message, f"{what}: {message!r} does not name {names}")
    expect(len(messages) == 1, f"{what}: ranks disagree: {messages}")


def bad_inputs(tmp: Path, backend) -> None:
    model, opt, sched = restart.build(backend, "ddp")
    before = [p.detach().clone() for p in model.parameters()]
    refused("missing", lambda: resume.load(tmp / "nowhere", backend, model, opt), "nowhere")
    (tmp / "empty").mkdir(exist_ok=True)
    refused("empty", lambda: resume.load(tmp / "empty", backend, model, opt), "is empty")
    root = tmp / "ddp"  # steps 10 (complete) and 15 (torn)
    small = restart.build(backend, "ddp", replace(restart.CONFIG, hidden=50))
    refused("another model", lambda: resume.load(root, backend, *small), "another model")
    zero = restart.build(backend, "zero1")
    refused("another optimizer", lambda: resume.load(root, backend, *zero), "ShardedOptimizer")
    sub = WORLD.Split(int(RANK < SIZE - 1), RANK)
    fewer = make_backend(backend.name, comm=sub)  # every rank: torch's groups are made by all
    if RANK < SIZE - 1:
        refused_sub = restart.build(fewer, "ddp")
        try:
            resume.load(root, fewer, *refused_sub)
            message = ""
        except resume.CheckpointError as exc:
            message = str(exc)
        expect(f"written by {SIZE} ranks, this job has {SIZE - 1}" in message
               and "manifest.json" in message, f"another world size: {message!r}")
    fewer.close()
    sub.Free()
    WORLD.Barrier()
    if RANK == 0:  # the last rank's file of the complete checkpoint, cut short
        shard = root / "step-00000010" / f"rank{SIZE - 1:05d}.pt"
        shard.write_bytes(shard.read_bytes()[:1000])
        manifest = json.loads((root / "step-00000010" / "manifest.json").read_text())
        expect(manifest["world_size"] == SIZE, "the manifest's world size")
    WORLD.Barrier()
    refused("truncated", lambda: resume.load(root, backend, model, opt, sched),
            f"rank{SIZE - 1:05d}.pt: 1000 bytes")
    expect(all(p.equal(b) for p, b in zip(model.parameters(), before, strict=True)),
           "a refused checkpoint changed the model")


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "mpi"
    parts = (sys.argv[2] if len(sys.argv) > 2 else "ddp,zero1,bad").split(",")
    backend = make_backend(name)
    tmp = Path(WORLD.bcast(tempfile.mkdtemp(prefix="pcourse-resume-") if RANK == 0 else None))
    lines: list[str] = []
    try:
        for strategy in restart.BUILDS:  # DDP-style, ZeRO-1 and FSDP
            if strategy in parts:
                exact(tmp, backend, strategy, lines)
        if "vae" in parts:
            vae_exact(tmp, backend, lines)
        if "bad" in parts:
            bad_inputs(tmp, backend)
    finally:
        WORLD.Barrier()
        if RANK == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    suffix = "" if name == "mpi" else f" ({name})"
    code = verdict(f"resume on {SIZE} ranks{suffix}", "\n".join(lines) if RANK == 0 else "")
    if code == 0 and RANK == 0:
        print(f"resume OK on {SIZE} ranks{suffix}", flush=True)
    backend.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
