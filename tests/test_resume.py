"""Checkpoints that resume exactly (lesson 14, :mod:`pcourse.resume`).

On MPI (tests/mpi/check_resume.py): a run interrupted and resumed equals the run never
interrupted bit for bit, for DDP-style averaging and ZeRO-1 at 3 ranks (2 in the slow set,
and Gloo), and in the slow set FSDP and the VAE at 2 and 3; the four resumes that each lose
one thing do not (but the VAE's noise is its epoch's table: it needs no generator state);
bad checkpoints are refused on every rank alike. Resharding 4 -> 2 and 3 -> 2
(check_reshard.py); a killed rank named from the launcher's reports, under MPICH and Open
MPI alike, a raising one from its own notice (check_notices.py); under torchrun
--max-restarts on Gloo, a killed rank's group restarted by torchrun and resumed exactly.
Here, in one process: the generators' round trip, what is skipped and what is refused, and
that nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pcourse import resume
from pcourse.tools.bench import restart

SLOW_P = [3, pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("p", SLOW_P)
def test_a_resumed_run_is_the_uninterrupted_one_and_each_lost_part_breaks_it(mpi_run, p):
    out = mpi_run(p, "check_resume.py", expect=f"resume OK on {p} ranks", timeout=300)
    for strategy in restart.STRATEGIES:
        for control in ("no generator state", "no data position", "no optimizer state",
                        "a torn write accepted"):
            assert f"{strategy} {control}: params differ by up to" in out


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_the_vae_resumes_exactly_and_needs_no_generator_state(mpi_run, p):
    out = mpi_run(p, "check_resume.py", "mpi", "vae", expect=f"resume OK on {p} ranks",
                  timeout=300)
    for control in ("no data position", "no optimizer state", "a torn write accepted"):
        assert f"vae {control}: params differ by up to" in out  # its noise: the epoch's table
    assert "vae no generator state" not in out  # checked exact in check_resume.py


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_fsdp_resumes_exactly_and_each_lost_part_breaks_it(mpi_run, p):
    out = mpi_run(p, "check_resume.py", "mpi", "fsdp", expect=f"resume OK on {p} ranks",
                  timeout=300)
    for control in ("no generator state", "no data position", "no optimizer state",
                    "a torn write accepted"):
        assert f"fsdp {control}: params differ by up to" in out


@pytest.mark.slow
@pytest.mark.parametrize("p, parts", [(2, "ddp,zero1,bad"), (3, "fsdp,vae")])
def test_resume_on_gloo(mpi_run, p, parts):
    """On Gloo too: each strategy and the VAE, exact, each lost part breaking it (DDP-style
    at 2 and 3 ranks under torchrun too, below)."""
    out = mpi_run(p, "check_resume.py", "gloo", parts, expect=f"resume OK on {p} ranks (gloo)",
                  timeout=300)
    for strategy in set(parts.split(",")) - {"bad"}:
        assert f"{strategy} no optimizer state: params differ by up to" in out


def test_the_generators_come_back_where_they_were():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.normal()  # numpy's cached Gaussian is state too
    state = resume.rng_state()
    want = (torch.rand(3), np.random.normal(size=3), [random.random() for _ in range(3)])
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    resume.set_rng_state(state)
    got = (torch.rand(3), np.random.normal(size=3), [random.random() for _ in range(3)])
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    assert want[2] == got[2]


def _saved(tmp: Path, one_rank, steps: tuple[int, ...]) -> tuple:
    backend = one_rank()
    model, opt, sched = restart.build(backend, "ddp")
    for step in steps:
        resume.save(tmp, backend, model, opt, resume.Progress(step=step, seed=5), sched,
                    keep=None)
    return backend, model, opt, sched


def test_the_newest_complete_checkpoint_is_loaded_and_the_rest_said(tmp_path, one_rank):
    backend, model, opt, sched = _saved(tmp_path, one_rank, (4, 8))
    (tmp_path / "step-00000012").mkdir()  # a write that never finished
    progress, said = resume.load(tmp_path, backend, model, opt, sched)
    assert progress.step == 8 and progress.seed == 5
    assert said == ("resumed from step-00000008; skipped step-00000012: no manifest.json "
                    "(a write that did not finish)")
    assert not list(tmp_path.rglob("*.tmp"))  # no temporary file left behind


def test_keep_leaves_the_newest_complete_ones(tmp_path, one_rank):
    backend = one_rank()
    model, opt, sched = restart.build(backend, "ddp")
    for step in (1, 2, 3):
        resume.save(tmp_path, backend, model, opt, resume.Progress(step=step), sched, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


def _refuses(tmp: Path, backend, parts, names: str) -> None:
    before = [p.detach().clone() for p in parts[0].parameters()]
    with pytest.raises(resume.CheckpointError, match="failed on rank 0") as info:
        resume.load(tmp, backend, *parts)
    assert names in str(info.value)
    assert all(torch.equal(p, b) for p, b in zip(parts[0].parameters(), before, strict=True))


def test_bad_checkpoints_are_refused_naming_the_file(tmp_path, one_rank):
    backend = one_rank()
    parts = restart.build(backend, "ddp")
    _refuses(tmp_path / "nowhere", backend, parts, "nowhere: no such folder")
    _refuses(tmp_path, backend, parts, "no complete checkpoint (the folder is empty)")
    _saved(tmp_path, one_rank, (4,))
    with torch.no_grad():
        for p in parts[0].parameters():
            p.add_(1.0)  # so that a partial load would show
    folder = tmp_path / "step-00000004"
    small = restart.build(backend, "ddp", restart.replace(restart.CONFIG, hidden=50))
    _refuses(tmp_path, backend, small, f"{folder / 'manifest.json'}: another model")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "world_size": 4}))
    _refuses(tmp_path, backend, parts, "written by 4 ranks, this job has 1; resuming at "
                                       "another world size needs resharding")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    shard = folder / "rank00000.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    _refuses(tmp_path, backend, parts, f"{shard}: {len(data) - 10} bytes, the manifest says "
                                       f"{len(data)}")
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    _refuses(tmp_path, backend, parts, f"{shard}: its SHA-256 differs")


class Canary:
    ran = False

    def __reduce__(self):
        return (setattr, (Canary, "ran", True))


def test_a_shard_that_would_run_code_is_refused_and_never_runs(tmp_path, one_rank):
    backend, model, opt, sched = _saved(tmp_path, one_rank, (4,))
    folder = tmp_path / "step-00000004"
    shard = folder / "rank00000.pt"
    torch.save({"model": Canary()}, shard)  # and a manifest that vouches for it
    manifest = json.loads((folder / "manifest.json").read_text())

    data = shard.read_bytes()
    manifest["files"]["rank00000.pt"] = {"bytes": len(data),
                                         "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refuses(tmp_path, backend, (model, opt, sched), f"{shard}: not a shard torch reads")
    assert not Canary.ran


def test_forget_takes_only_the_parts(tmp_path, one_rank):
    backend, model, opt, sched = _saved(tmp_path, one_rank, (4,))
    with pytest.raises(ValueError, match="forget takes some of"):
        resume.load(tmp_path, backend, model, opt, forget=["weights"])


@pytest.mark.slow
def test_a_checkpoint_of_4_or_3_ranks_resumes_at_2_when_asked(mpi_run):
    out = mpi_run(4, "check_reshard.py", expect="reshard OK", timeout=300)
    for case in ("ddp 4 -> 2", "zero1 4 -> 2", "ddp 3 -> 2", "zero1 3 -> 2"):
        assert f"{case}: first loss differs by" in out


def test_the_rank_exit_wrapper_reads_the_ranks_variables():
    from pcourse.runtime.ranks import MPI_RANK_VARS
    from pcourse.tools.cluster import rank_exit

    assert rank_exit._RANK_VARS == MPI_RANK_VARS  # it cannot import them: standard library only


def test_the_rank_that_died_first_is_named_from_the_launchers_reports():
    """Rank 2 of 3 kills itself; the others end a moment later (by themselves, or ended by
    the launcher: Open MPI's ends them at once). The line names rank 2 and SIGKILL, from the
    exits the launcher's ranks reported (not rank 0, not the last to exit, not whoever
    exited with an error), under MPICH and Open MPI alike: one wrapper reports for both."""
    import os
    import subprocess
    import sys

    from pcourse.runtime.ranks import MPI_RANK_VARS
    from pcourse.tools.cluster import launch
    from pcourse.tools.cluster.failures import rank_exits, who_died

    launcher = launch.mpi_launcher()
    code = ("import os, signal, time\n"
            f"rank = next(os.environ[v] for v in {MPI_RANK_VARS!r} if v in os.environ)\n"
            "if rank == '2': os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(1)\n"
            "raise SystemExit(3 if rank == '0' else 0)")
    done = subprocess.run([*launcher.command, "-n", "3", *launcher.wrap, sys.executable,
                           "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **launcher.env})
    said = who_died(done.stdout)
    assert said.startswith("rank 2 ended first (killed by SIGKILL); then ended "), said
    others = dict(rank_exits(done.stdout)[1:])
    if launch.mpi_flavour() == "mpich":  # its forker lets them end by themselves
        assert others == {0: "exit status 3", 1: "exit status 0"}, said
    else:  # Open MPI ends them (SIGTERM) unless they ended first: either way, each named
        assert sorted(others) == [0, 1], said
    assert who_died("") == ""


@pytest.mark.mpi
@pytest.mark.parametrize("where, rank, step", [
    ("save", 1, 15),
    pytest.param("compute", 2, 12, marks=pytest.mark.slow),
    pytest.param("collective", 1, 7, marks=pytest.mark.slow)])
def test_a_rank_killed_ends_the_job_and_is_named(tmp_path, where, rank, step):
    """One of 3 ranks kills itself with SIGKILL (in a checkpoint write, in compute, in a
    collective): every rank's exit is reported, the first named as the killed rank, from
    the ranks' own reports; killed in a write, the torn checkpoint is skipped, saying why,
    and the newest complete one is the one before."""
    from pcourse.tools.cluster.launch import mpi_flavour, mpirun

    job = mpirun(3, ["-m", "pcourse.tools.bench.restart", "--kill", str(rank), str(step),
                     where, "--root", str(tmp_path), "--deadline", "10"],
                 timeout=120, check=False)
    assert job.returncode == 137, job.stdout[-3000:]
    assert job.ended.startswith(f"rank {rank} ended first (killed by SIGKILL)"), \
        job.ended  # under MPICH and Open MPI alike: the wrapper reports for both
    if mpi_flavour() == "mpich":  # its forker lets every rank end and report; Open MPI may
        #                          kill a rank's wrapper with it, and that rank goes unreported
        assert all(f"rank {r} (" in job.ended for r in range(3) if r != rank), job.ended
    folder, skipped = resume.latest(tmp_path)
    if where == "save":
        assert folder.name == "step-00000010"
        assert skipped == ["step-00000015: no manifest.json (a write that did not finish)"]
        assert (tmp_path / "step-00000015" / f"rank{rank:05d}.pt").is_file()  # it died after
    else:
        assert folder.name == f"step-{step // 5 * 5:08d}" and not skipped


@pytest.mark.parametrize("p", SLOW_P)
def test_a_rank_that_raises_is_named_by_the_others_and_a_silent_one_is_not(mpi_run, p):
    mpi_run(p, "check_notices.py", expect=f"notices OK on {p} ranks", timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_torchrun_restarts_the_group_and_the_resume_is_exact(tmp_path, p):
    """Under ``torchrun --max-restarts 1`` on Gloo, the last rank kills itself before step 7
    on the first attempt: torchrun's agent says it restarts the group, every worker of the
    new attempt reads attempt 1 from torchrun, resumes from step 5 (the newest complete
    checkpoint) and ends equal to the run never interrupted, bit for bit."""
    from pcourse.tools.bench import elastic

    log, ranks = elastic.launch(p, str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                kill=(p - 1, 7), timeout=240)
    assert len(elastic.RESTARTED.findall(log)) == 1, log[-3000:]
    assert [r["rank"] for r in ranks] == list(range(p)), ranks
    for r in ranks:
        assert r["attempt"] == 1 and r["said"] == "resumed from step-00000005", r
        assert r["params"] and r["optimizer"] and r["losses"], r


@pytest.mark.slow
def test_under_torchrun_a_resume_without_the_generators_is_not_exact(tmp_path):
    """The same restart with a resume that forgets the generators: the check above fails."""
    from pcourse.tools.bench import elastic

    log, ranks = elastic.launch(2, str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                kill=(1, 7), forget=("rng",), timeout=240)
    assert len(elastic.RESTARTED.findall(log)) == 1, log[-3000:]
    assert [r["attempt"] for r in ranks] == [1, 1], ranks
    assert not any(r["params"] or r["losses"] for r in ranks), ranks
