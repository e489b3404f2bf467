"""Grading: exercises/ is generated from solutions/, and nbval grading is strict.

A grader's worst case is a check that passes a wrong answer. So, for every exercise:
the shipped (unsolved) notebook fails; the solution injected into it passes (which
proves the injection below works); and at least two plausible wrong solutions,
injected the same way, fail. All those notebooks are graded in one pytest process
(one kernel and one engine cluster per notebook), once per test session.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest

from pcourse.grading import exercises as ex
from pcourse.grading.grade import Grade, explain, grade, table

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS, EXERCISES = REPO / "solutions", REPO / "exercises"
NAMES = sorted(p.stem for p in SOLUTIONS.glob("*.ipynb"))
RIGHT = None  # in a variant: this region keeps the real solution

# exercise -> variant -> (code for each region, what the first failure must mention)
WRONG: dict[str, dict[str, tuple[list, str]]] = {
    "01_partitioner": {
        "a different shuffle seed on each rank": (["""
            gen = torch.Generator().manual_seed(seed + epoch + rank)
            order = torch.randperm(n, generator=gen)
            per = n // size
            return order[rank * per:(rank + 1) * per].tolist()"""], "check 1/3"),
        "remainder spread over the ranks (ceil)": (["""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            per = -(-n // size)
            return order[rank * per:(rank + 1) * per].tolist()"""], "n // size"),
    },
    "02_average_gradients": {
        "forgot to divide by the world size": (["""
            for p in model.parameters():
                p.grad = comm.allreduce(p.grad, op=MPI.SUM)""", RIGHT], "2 times"),
        "Allreduce of a copy, gradient untouched": ([RIGHT, """
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy().copy(), op=MPI.SUM)
                p.grad /= comm.size"""], "check 2/3"),
    },
    "03_ring_allreduce": {
        "off by one in the allgather chunks": (["""
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Sendrecv(send, dest=right, recvbuf=incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""], "check 1/3"),
        "equal chunks of n // p, remainder forgotten": (["""
            c = len(x) // p
            chunks = [x[i * c:(i + 1) * c] for i in range(p)]
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Sendrecv(send, dest=right, recvbuf=incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""], "check 2/3"),
        "whole buffers swapped, not chunks": (["""
            incoming = np.empty_like(x)
            comm.Sendrecv(x.copy(), dest=right, recvbuf=incoming, source=left)
            x += incoming"""], "check 3/3"),
    },
    "04_gloo_bootstrap": {
        "the source's hard-coded port 29500": (["""
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
                                    rank=comm.rank, world_size=comm.size,
                                    timeout=timedelta(seconds=timeout_s))
            return "127.0.0.1", 29500"""], "check 1/3"),
        "no timeout given": (["""
            where = None
            if comm.rank == 0:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    where = s.getsockname()
            addr, port = comm.bcast(where, root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                    rank=comm.rank, world_size=comm.size)
            return addr, port"""], "check 3/3"),
    },
    "05_broadcast_consistency": {
        "broadcast from rank 0 whatever the root": (["""
            for t in [*model.parameters(), *model.buffers()]:
                comm.Bcast(t.detach().numpy(), root=0)""", RIGHT], "check 2/3"),
        "parameters only, buffers forgotten": (["""
            for t in model.parameters():
                comm.Bcast(t.detach().numpy(), root=root)""", RIGHT], "running_mean"),
    },
    "06_bucketed_allreduce": {
        "every slice taken at offset 0": (["""
            grads = [p.grad for p in model.parameters()]
            bucket = torch.cat([g.reshape(-1) for g in grads])
            comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
            bucket /= comm.size
            for g in grads:
                g.copy_(bucket[:g.numel()].view_as(g))"""], "check 2/3"),
        "one Allreduce per parameter, no bucket": (["""
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad /= comm.size"""], "check 1/3"),
    },
    "07_parameter_averaging": {
        "summed instead of averaged": (["""
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)""", RIGHT],
                                       "check 1/3"),
        "averages after steps 0, period, ... (off by one)": ([RIGHT, """
            if step % period == 0:
                average_parameters(model, comm)"""], "check 3/3"),
    },
}


def _solution(name: str) -> nbformat.NotebookNode:
    return nbformat.read(SOLUTIONS / f"{name}.ipynb", as_version=4)


def _exercise(name: str) -> nbformat.NotebookNode:
    return nbformat.read(EXERCISES / f"{name}.ipynb", as_version=4)


def _variants(tmp: Path) -> dict[tuple[str, str], Path]:
    """Every notebook to grade: shipped, solved, and each wrong variant of each exercise."""
    paths = {}
    for name in NAMES:
        real = ex.solution_regions(_solution(name))
        shipped = tmp / f"{name}.ipynb"
        shutil.copy(EXERCISES / shipped.name, shipped)
        paths[(name, "shipped")] = shipped
        variants = {"solved": real}
        for j, (label, (codes, _)) in enumerate(WRONG[name].items()):
            variants[label] = [real[k] if c is RIGHT else c for k, c in enumerate(codes)]
            paths[(name, label)] = tmp / f"{name}__wrong{j}.ipynb"
        paths[(name, "solved")] = tmp / f"{name}__solved.ipynb"
        for label, codes in variants.items():
            nbformat.write(ex.inject(_exercise(name), codes), paths[(name, label)])
    return paths


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[tuple[str, str], Grade]:
    paths = _variants(tmp_path_factory.mktemp("graded"))
    grades = grade(list(paths.values()), jobs=2)
    print(table(grades))  # shown by pytest when a test below fails
    by_path = {g.path: g for g in grades}
    return {key: by_path[path] for key, path in paths.items()}


# ---------------------------------------------------------------- generation (fast)

def test_there_are_seven_exercises_each_with_wrong_solutions():
    assert len(NAMES) >= 7
    assert set(WRONG) == set(NAMES)
    assert all(len(v) >= 2 for v in WRONG.values())


def test_exercises_are_generated_from_the_solutions():
    assert ex.stale(SOLUTIONS, EXERCISES) == [], "run `make exercises` and commit the result"


def test_stale_exercises_are_detected(tmp_path):
    shutil.copytree(EXERCISES, tmp_path / "ex")
    victim = tmp_path / "ex" / f"{NAMES[0]}.ipynb"
    nb = nbformat.read(victim, as_version=4)
    cell = next(c for c in nb.cells if "check" in c.metadata.get("tags", []))
    cell.outputs[0]["text"] = cell.outputs[0]["text"].replace("PASS", "FAIL")
    nbformat.write(nb, victim)
    (tmp_path / "ex" / "99_orphan.ipynb").write_text(victim.read_text())
    problems = ex.stale(SOLUTIONS, tmp_path / "ex")
    assert any(victim.name in p and "differs" in p for p in problems)
    assert any("99_orphan" in p for p in problems)


@pytest.mark.parametrize("name", NAMES)
def test_exercise_hides_the_solution_and_keeps_the_expected_outputs(name):
    solution, exercise = _solution(name), _exercise(name)
    regions = ex.solution_regions(solution)
    assert regions, "a solution must mark what the learner writes"
    text = "\n".join(c.source for c in exercise.cells)
    assert ex.BEGIN not in text and ex.END not in text and "### HINT" not in text
    assert text.count("raise NotImplementedError(") == len(regions)
    for sol, exe in zip(solution.cells, exercise.cells, strict=True):
        tags = exe.metadata.get("tags", [])
        if "check" in tags:  # nbval compares these: outputs and execution count kept
            assert exe.outputs == sol.outputs and exe.execution_count is not None
            assert re.search(r"check \d+/\d+ .*: PASS", exe.outputs[0]["text"])
        if exe.cell_type == "code" and ex.YOUR_CODE in exe.source:
            assert exe.outputs == [] and exe.execution_count is None
    assert sum("check" in c.metadata.get("tags", []) for c in exercise.cells) >= 3


def test_markers_must_pair_up():
    with pytest.raises(ex.MarkerError, match="never closed"):
        ex.strip_solutions("x = 1\n### BEGIN SOLUTION\ny = 2")
    with pytest.raises(ex.MarkerError, match="without"):
        ex.strip_solutions("### END SOLUTION")
    with pytest.raises(ex.MarkerError, match="inside another"):
        ex.strip_solutions("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION")


def test_strip_and_inject_round_trip():
    source = ("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    ### HINT: add one\n"
              "    return x + y\n    ### END SOLUTION")
    stub = ex.strip_solutions(source)
    assert stub == ("def f(x):\n    y = 1\n    # YOUR CODE HERE\n    # Hint: add one\n"
                    "    raise NotImplementedError('add one')")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(stub)])
    filled = ex.inject(nb, ["return x - y"])
    assert filled.cells[0].source == "def f(x):\n    y = 1\n    return x - y"
    with pytest.raises(ValueError, match="1 regions"):
        ex.inject(nb, ["a", "b"])


def test_failures_are_explained_in_plain_words():
    got = ("Cell 4: Cell outputs differ\nInput: ...\nTraceback: mismatch 'stdout'\n"
           "  'check 2/3 sh...: PASS\\n' == 'check 2/3 sh...s [3]\\n'\n"
           "  Skipping 12 identical leading characters in diff, use -v to show\n"
           "  - uffle: FAIL: rank 1's share is [3]\n  + uffle: PASS\n")
    assert explain(got, "check 2/3 shuffle: PASS") == ("expected 'check 2/3 shuffle: PASS' but "
                                                       "got \"check 2/3 shuffle: FAIL: rank 1's "
                                                       "share is [3]\"")
    quoted = ("Cell outputs differ\nTraceback: 'check 1/1 x: PASS\\n' == "
              "\"check 1/1 x: FAIL: it's wrong\\n\"\n")
    assert explain(quoted, "check 1/1 x: PASS").endswith('got "check 1/1 x: FAIL: it\'s wrong"')
    raised = ("Cell execution caused an exception\nTraceback ...\n"
              "ExerciseError: rank 0 raised NotImplementedError: write shard\n\nmore")
    assert explain(raised, None).startswith("not solved yet")
    assert explain("Timeout of 5 seconds exceeded executing cell", None).startswith(
        "the cell did not finish")


# ---------------------------------------------------------------- grading (one nbval run)

@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name", NAMES)
def test_shipped_exercise_fails_as_unsolved(graded, name):
    g = graded[(name, "shipped")]
    assert not g.ok and g.passed == 0 and g.total >= 3, g
    assert "not solved yet" in g.first_failure, g


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name", NAMES)
def test_injected_solution_passes(graded, name):
    g = graded[(name, "solved")]
    assert g.ok and g.passed == g.total >= 3, g


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name,label", [(n, label) for n in NAMES for label in WRONG[n]])
def test_wrong_solution_fails(graded, name, label):
    g = graded[(name, label)]
    assert not g.ok, f"the grader passed a wrong solution ({label}): {g}"
    assert g.passed < g.total
    assert WRONG[name][label][1] in g.first_failure, g
