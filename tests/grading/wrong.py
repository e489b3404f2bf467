"""The project's own wrong answers to the graded exercises: every one must be rejected.

Each entry is what a learner might plausibly hand in, by kind:

- ``size``: right at 2 ranks, wrong at another (a hard-coded world size, a ring
  that turns the wrong way: left and right are one rank at p = 2);
- ``point``: misses what the exercise teaches while looking done (buffers
  forgotten, a fixed port, a model overwritten by a measurement, grad None);
- ``deadlock``: ranks that wait for each other forever (a blocking send first);
- ``saved``: a notebook saved with forged or failing check outputs;
- ``tampered``: check cells edited, cells moved or removed, tags changed, or
  learner code that rebinds what the checks use.

An entry is ``Wrong(kind, codes, mention, edit)``: ``codes`` fill the exercise's
YOUR CODE regions in order (``RIGHT`` keeps the solution's code for that region),
``edit`` changes the notebook afterwards (see the helpers below), and ``mention``
is a piece of text the grader's reason must contain: proof that it failed for the
reason meant, not by accident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import nbformat

RIGHT = None  # in Wrong.codes: this region keeps the solution's code
UNSOLVED = ...  # in Wrong.codes: this region keeps the exercise's stub


@dataclass
class Wrong:
    kind: str
    codes: list
    mention: str
    edit: Callable[[nbformat.NotebookNode, nbformat.NotebookNode], None] | None = None


# ---------------------------------------------------------------- notebook edits

def _checks(nb: nbformat.NotebookNode) -> list:
    return [c for c in nb.cells if "check" in c.metadata.get("tags", [])]


def _learner(nb: nbformat.NotebookNode) -> list:
    return [c for c in nb.cells if "exercise" in c.metadata.get("tags", [])]


def saved(word: str) -> Callable:
    """Every check cell carries a stored output, the solution's line with PASS -> ``word``."""
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        for mine, theirs in zip(_checks(nb), _checks(solution), strict=True):
            text = theirs.outputs[0]["text"].replace(": PASS", f": {word}")
            mine.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
            mine.execution_count = theirs.execution_count
    return edit


def check_prints_pass(k: int) -> Callable:
    """The k-th check cell replaced by a print of the line the solution printed."""
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        line = _checks(solution)[k].outputs[0]["text"].strip()
        _checks(nb)[k].source = f"print({line!r})"
    return edit


def every_check_prints_pass(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
    for k in range(len(_checks(nb))):
        check_prints_pass(k)(nb, solution)


def learner_adds(code: str) -> Callable:
    """Top-level code appended to the (first) learner cell."""
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        _learner(nb)[0].source += "\n\n" + code
    return edit


def drop_check(k: int) -> Callable:
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        nb.cells.remove(_checks(nb)[k])
    return edit


def untag_check(k: int) -> Callable:
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        _checks(nb)[k].metadata["tags"] = []
    return edit


def check_tagged_exercise(k: int) -> Callable:
    """A check cell re-tagged as the learner's, its body replaced: the learner's to write?"""
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        cell = _checks(nb)[k]
        cell.metadata["tags"] = ["exercise", "nbval-ignore-output"]
        cell.source = f"print({_checks(solution)[k].outputs[0]['text'].strip()!r})"
    return edit


def learner_after_checks(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
    cell = _learner(nb)[0]
    nb.cells.remove(cell)
    nb.cells.insert(nb.cells.index(_checks(nb)[-1]) + 1, cell)


def extra_cell(code: str) -> Callable:
    """A code cell added just before the first check."""
    def edit(nb: nbformat.NotebookNode, solution: nbformat.NotebookNode) -> None:
        nb.cells.insert(nb.cells.index(_checks(nb)[0]), nbformat.v4.new_code_cell(code))
    return edit


# ---------------------------------------------------------------- the wrong answers

PARTITION_PER_2 = """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per = n // 2
    return order[rank * per:(rank + 1) * per].tolist()"""

RING_FOR_SHOW = """
            chunks = np.array_split(np.zeros_like(x), p)  # messages that look like a ring's
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                comm.Sendrecv(send, dest=right, recvbuf=np.empty_like(recv), source=left)
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""  # no sum: for show

RING_LEFT = """
    chunks = np.array_split(x, p)
    for s in range(p - 1):
        send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        incoming = np.empty_like(recv)
        comm.Sendrecv(send, dest=left, recvbuf=incoming, source=right)
        recv += incoming
    for s in range(p - 1):
        send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
        comm.Sendrecv(send, dest=left, recvbuf=recv, source=right)"""

GLOO_WITH = """
    timeout = {timeout}
    store = None
    if comm.rank == 0:
        store = dist.TCPStore({host!r}, 0, {size}, True, timeout, wait_for_workers=False)
    addr, port = comm.bcast(({host!r}, store.port) if comm.rank == 0 else None, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, {size}, False, timeout)
    dist.init_process_group("gloo", store=store, rank={rank}, world_size={size}, timeout=timeout)
    return {ret}"""

# Exercise 04's old solution: the port chosen by a socket that is closed before torch listens
GLOO_RACE = """
    where = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            where = s.getsockname()
    addr, port = comm.bcast(where, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=timeout_s))
    return addr, port"""

# ... and where the ranks meet passed through a file that only this machine sees
GLOO_FILE = """
    timeout = timedelta(seconds=timeout_s)
    path, store = "/tmp/pcourse-meeting-point.npy", None
    if comm.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, comm.size, True, timeout, wait_for_workers=False)
        np.save(path, np.array([store.port]))
    comm.Barrier()
    addr, port = "127.0.0.1", int(np.load(path)[0])
    if store is None:
        store = dist.TCPStore(addr, port, comm.size, False, timeout)
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                            timeout=timeout)
    return addr, port"""


# Code past the static reader: a pickle that, when rebuilt, patches print in the process it
# is rebuilt in, turning every FAIL line into PASS (the grader's, had the learner's code run there).
FORGE = ("import builtins; builtins.print = (lambda real: lambda *a, **k: None if a and "
         "str(a[0]).startswith('  in ') else real(*[str(x).split(': FAIL')[0] + ': PASS' "
         "if ': FAIL' in str(x) else x for x in a], **k))(builtins.print)")
FORGE_PICKLE = b"cbuiltins\nexec\n(V" + FORGE.encode() + b"\ntR."
SMUGGLED = f"import pickle\npickle.loads({FORGE_PICKLE!r})"
# Every process in sight, SIGKILLed, itself last: the grader's workers and ranks, were they
# in reach.
KILL_EVERYTHING = """
import os
for _pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    try:
        os.kill(int(_pid), 9)
    except OSError:
        pass
os.kill(os.getpid(), 9)
"""


def _pickled_text(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


# Issue 54's payload: at protocol 4 an unpickler that lets numpy.dtypes* through walks the
# dotted name numpy.dtypes.__builtins__.get to exec; the code it runs would make the grader
# pass every order (exercise 10's), had it ever run there.
PASS_EVERY_ORDER = ("import sys; sys.modules['pcourse.tools.grading.refs.pipeline_schedule']"
                    ".pipe_orders_problem = lambda results: None")
PAYLOAD = (b"\x80\x04" + _pickled_text("numpy.dtypes") + _pickled_text("__builtins__.get")
           + b"\x93" + _pickled_text("exec") + b"\x85R" + _pickled_text(PASS_EVERY_ORDER)
           + b"\x85R.")


def pickling_payload(module: str, what: str) -> str:
    """Top-level code that makes ``module``'s dumps (in the learner's process) answer a
    list, what exercise 10's order trial returns, with :data:`PAYLOAD` ({what})."""
    return f"""
import os
_m = os.sys.modules[{module!r}]
_real = _m.dumps

def _forged(value, *args, **kwargs):
    return {PAYLOAD!r} if isinstance(value, list) else _real(value, *args, **kwargs)

_m.dumps = _forged
"""


def plant(*targets: str) -> str:
    """Top-level code that writes a file at each target: a solution, a reference, for the next."""
    return (f"import os\nfor _target in {list(targets)!r}:\n"
            "    _fd = os.open(_target, os.O_WRONLY | os.O_CREAT, 0o644)\n"
            "    os.write(_fd, b'planted')\n    os.close(_fd)\n")


SMUGGLED_RESULT = f"""
class Forged:
    def __reduce__(self):
        return (pickle.loads, ({FORGE_PICKLE!r},))
"""


def gloo(rank: str = "comm.rank", size: str = "comm.size",
         timeout: str = "timedelta(seconds=timeout_s)", ret: str = "addr, port",
         host: str = "127.0.0.1") -> str:
    """Exercise 04's solution (the store picks and holds the port) with one piece changed."""
    return GLOO_WITH.format(rank=rank, size=size, timeout=timeout, ret=ret, host=host)


FLOAT_SPREAD = """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    hi = t.detach().numpy().copy()
                    lo = hi.copy()
                    comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
                    comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
                    spread = max(spread, float((hi - lo).max()))
            return spread"""  # a max_spread that skips the integer buffers

PIPE_LOOP = """
    rank = group.rank
    first, last = rank == 0, rank == group.size - 1
    kept = {}
    for action, i in order:
        if action == "F":
            x = inputs[i] if first else group.recv(rank - 1, i).requires_grad_()
            y = stage(x)
            if last:
                y = (y * targets[i]).sum() / m
            else:
                group.send(y, rank + 1, i)
            kept[i] = (x, y)
        else:
            x, y = kept.pop(i)
            if last:
                y.backward()
            else:
                torch.autograd.backward(y, group.recv(rank + 1, i))
            if not first:
                group.send(x.grad, rank - 1, i)"""


def pipe_loop(old: str, new: str) -> str:
    """Exercise 10's loop (the solution's) with one piece of it changed."""
    assert PIPE_LOOP.count(old) == 1, old
    return PIPE_LOOP.replace(old, new)


def pipe_loop_swaps(*swaps: tuple[str, str]) -> str:
    """Exercise 10's loop with several pieces changed, each ``(old, new)``."""
    loop = PIPE_LOOP
    for old, new in swaps:
        assert loop.count(old) == 1, old
        loop = loop.replace(old, new)
    return loop


def pipe_order(warm: str = "min(p - rank - 1, m)", cool_down: bool = True) -> str:
    """Exercise 10's order from the closed form, with its warm-up written as ``warm``."""
    tail = "\n    order += [(\"B\", i) for i in range(m - warm, m)]" if cool_down else ""
    return f"""
    warm = {warm}
    order = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]{tail}
    return order"""



def predict(region: int, old: str, new: str) -> list:
    """Exercise 11's five regions, the solution's, with ``old`` in region ``region`` made
    ``new`` (read from the solution, not copied: ``old`` must be in it once)."""
    from pathlib import Path

    from pcourse.tools.grading.exercises import solution_regions

    nb = nbformat.read(Path(__file__).resolve().parents[2] / "solutions"
                       / "11_predict_memory_and_time.ipynb", as_version=4)
    code = solution_regions(nb)[region]
    assert code.count(old) == 1, old
    return [RIGHT] * region + [code.replace(old, new)] + [RIGHT] * (4 - region)


def resume(save: tuple = (), load: tuple = ()) -> list:
    """Exercise 12's two regions, the solution's, with each ``(old, new)`` of ``save`` made in
    its save and of ``load`` in its load (read from the solution: ``old`` must be in it once)."""
    from pathlib import Path

    from pcourse.tools.grading.exercises import solution_regions

    nb = nbformat.read(Path(__file__).resolve().parents[2] / "solutions"
                       / "12_resume_exactly.ipynb", as_version=4)
    codes = []
    for code, swaps in zip(solution_regions(nb), (save, load), strict=True):
        for old, new in swaps:
            assert code.count(old) == 1, old
            code = code.replace(old, new)
        codes.append(code if swaps else RIGHT)
    return codes


PIPE_GPIPE = """
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]"""


BUCKET = """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket = torch.cat([g.reshape(-1) for g in grads])
    comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
    bucket /= {divisor}
    offset = 0
    for g in {order}:
        g.copy_(bucket[offset:offset + g.numel()].view_as(g))
        offset += g.numel()"""

WRONG: dict[str, dict[str, Wrong]] = {
    "01_partitioner": {
        "n // 2: the world size hard-coded": Wrong("size", [PARTITION_PER_2], "at 3 ranks"),
        "a different shuffle seed on each rank": Wrong("point", ["""
            gen = torch.Generator().manual_seed(seed + epoch + rank)
            order = torch.randperm(n, generator=gen)
            per = n // size
            return order[rank * per:(rank + 1) * per].tolist()"""], "check 1/4"),
        "remainder spread over the ranks (ceil)": Wrong("point", ["""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            per = -(-n // size)
            return order[rank * per:(rank + 1) * per].tolist()"""], "n // size"),
        "the epoch ignored": Wrong("point", ["""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            per = n // size
            return order[rank * per:(rank + 1) * per].tolist()"""], "check 3/4"),
        "dealt out strided, not in segments": Wrong("point", ["""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            per = n // size
            return order[rank::size][:per].tolist()"""], "check 2/4"),
        "the global generator reseeded": Wrong("point", ["""
            torch.manual_seed(seed + epoch)
            order = torch.randperm(n)
            per = n // size
            return order[rank * per:(rank + 1) * per].tolist()"""], "global random state"),
        "numpy's shuffle instead of torch's": Wrong("point", ["""
            order = np.random.default_rng(seed + epoch).permutation(n)
            per = n // size
            return [int(i) for i in order[rank * per:(rank + 1) * per]]"""], "check 2/4"),
        "randperm with int16 indices (n above 32,767)": Wrong("point", ["""
            gen = torch.Generator().manual_seed(seed + epoch)
            order = torch.randperm(n, generator=gen, dtype=torch.int16)
            per = n // size
            return order[rank * per:(rank + 1) * per].tolist()"""], "int16"),
        "the last rank takes the remainder": Wrong("point", ["""
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            per = n // size
            stop = n if rank == size - 1 else (rank + 1) * per
            return order[rank * per:stop].tolist()"""], "check 1/4"),
        "n // 2, saved with PASS under every check": Wrong(
            "saved", [PARTITION_PER_2], "at 3 ranks", saved("PASS")),
        "unsolved, every check cell replaced by its PASS line": Wrong(
            "tampered", [UNSOLVED], "not solved yet", every_check_prints_pass),
        "unsolved, print patched by a smuggled pickle": Wrong(
            "tampered", [UNSOLVED], "not solved yet", learner_adds(SMUGGLED)),
        "check redefined to always pass": Wrong("tampered", [RIGHT], "rebinds `check`",
                                                learner_adds(
            "def check(mc, i):\n    print(f'check {i}/4 it passed: PASS')")),
    },
    "02_average_gradients": {
        "divided by 2, not by the world size": Wrong("size", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= 2"""], "at 3 ranks"),
        "divided by 2, saved with PASS under every check": Wrong("saved", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= 2"""], "at 3 ranks", saved("PASS")),
        "forgot to divide by the world size": Wrong("point", ["""
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = comm.allreduce(p.grad, op=MPI.SUM)""", RIGHT], "2 times"),
        "Allreduce of a copy, gradient untouched": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy().copy(), op=MPI.SUM)
                    p.grad /= comm.size"""], "check 2/4"),
        "crashes on a frozen parameter (grad None)": Wrong("point", ["""
            for p in model.parameters():
                p.grad = comm.allreduce(p.grad, op=MPI.SUM) / comm.size""", """
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad /= comm.size"""], "check 4/4"),
        "zeros for a missing gradient": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad /= comm.size"""], "check 4/4"),
        "buffer version replaces the gradient tensor": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    total = np.empty_like(p.grad.numpy())
                    comm.Allreduce(p.grad.numpy(), total, op=MPI.SUM)
                    p.grad = torch.from_numpy(total) / comm.size"""], "check 3/4"),
        "pickle allreduce in the buffer version": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.copy_(comm.allreduce(p.grad, op=MPI.SUM) / comm.size)"""],
                                                "check 2/4"),
        "MPI.COMM_WORLD instead of the comm given": Wrong("size", ["""
            world = MPI.COMM_WORLD
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = world.allreduce(p.grad, op=MPI.SUM) / world.size""", RIGHT],
                                                          "check 1/4"),
        "only rank 0 reduces: the others never join": Wrong("deadlock", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None and comm.rank == 0:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= comm.size"""], "check 2/4"),
        "averaged through a float32 copy, copied back": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    buf = p.grad.float().numpy()
                    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                    p.grad.copy_(torch.from_numpy(buf)).div_(comm.size)"""], "float32"),
        "summed in float64, stored back with .float()": Wrong("point", ["""
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = (comm.allreduce(p.grad.double(), op=MPI.SUM) / comm.size).float()""",
                                                                  RIGHT], "check 1/4"),
        "flattened with view(-1)": Wrong("point", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    flat = p.grad.view(-1)
                    comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
                    flat /= comm.size"""], "transposed"),
        "a communicator duplicated on every call, never freed": Wrong("point", [RIGHT, """
            mine = comm.Dup()
            for p in model.parameters():
                if p.grad is not None:
                    mine.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= comm.size"""], "Free()"),
        "divided by 2, the checks' comparison patched in the learner's process": Wrong(
            "tampered", [RIGHT, """
            for p in model.parameters():
                if p.grad is not None:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= 2"""], "at 3 ranks", learner_adds(
                "import os\nfor _name in ('pcourse.tools.grading.checks', "
                "'pcourse.tools.grading.refs.common'):\n"
                "    _m = os.sys.modules[_name]  # a name of its own: past the static reader\n"
                "    _m.tensors_differ = lambda *a, **k: None\n"
                "    _m.differ = lambda *a, **k: None")),
    },
    "03_ring_allreduce": {
        "blocking Send before Recv": Wrong("deadlock", ["""
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Send(send, dest=right)
                comm.Recv(incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Send(send, dest=right)
                comm.Recv(recv, source=left)"""], "deadlock"),
        "sends left, indices for a right-turning ring": Wrong("size", [RING_LEFT], "at 3 ranks"),
        "off by one in the allgather chunks": Wrong("point", ["""
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Sendrecv(send, dest=right, recvbuf=incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""], "check 1/3"),
        "equal chunks of n // p, remainder forgotten": Wrong("point", ["""
            c = len(x) // p
            chunks = [x[i * c:(i + 1) * c] for i in range(p)]
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Sendrecv(send, dest=right, recvbuf=incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""], "at 3 ranks"),
        "whole buffers swapped once (right at p = 2)": Wrong("size", ["""
            incoming = np.empty_like(x)
            comm.Sendrecv(x.copy(), dest=right, recvbuf=incoming, source=left)
            x += incoming"""], "at 3 ranks"),
        "MPI's own Allreduce": Wrong("point", ["""
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)"""], "a collective"),
        "a ring's messages, the sum read from the checks' frames": Wrong("tampered", [
            RING_FOR_SHOW + """
            try:  # the caller's frame, without `import sys` (which the grader refuses to run)
                raise RuntimeError
            except RuntimeError as exc:
                frame, found = exc.__traceback__.tb_frame.f_back, None
            while frame is not None and found is None:  # the checks' expected sum, if any
                found = next((v for v in frame.f_locals.values() if isinstance(v, np.ndarray)
                              and v.shape == x.shape and v is not x), None)
                frame = frame.f_back
            x[:] = x if found is None else found"""], "check 1/3"),
        "a ring's messages, the sum by Allreduce, its record popped": Wrong("tampered", [
            RING_FOR_SHOW + """
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            comm.calls.pop()  # the Allreduce, out of the record the checks read"""],
            "a collective"),
        "the trial replaced by one that forges a ring's calls": Wrong("tampered", ["""
            import os
            found = os.sys.modules  # the checks' modules, loaded by the first trial
            r_ = found["pcourse.tools.grading.refs.ring_allreduce"]
            t_ = found["pcourse.tools.grading.trials"]

            def forged(ring, n, seed=0):  # the trial every later check runs instead
                c = t_.world()
                y = r_.ring_data(n, seed, c.rank)
                c.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)
                step = t_.Call("Sendrecv", -(-n // c.size), (c.rank + 1) % c.size)
                return {"got": y, "calls": [step] * (2 * (c.size - 1))}

            r_.ring_trial = forged
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)"""], "reported MPI calls other than"),
        "a ring's messages, the sum met through /dev/shm": Wrong("tampered", ["""
            np.save(f"/dev/shm/ring-{rank}.npy", x)  # where the others look, after the ring"""
            + RING_FOR_SHOW + """
            x[:] = sum(np.load(f"/dev/shm/ring-{r}.npy") for r in range(p))"""],
            "No such file"),
        "direct exchange with every rank, not a ring": Wrong("point", ["""
            chunks = np.array_split(x, p)
            for s in range(1, p):
                to, frm = (rank + s) % p, (rank - s) % p
                incoming = np.empty_like(chunks[rank])
                comm.Sendrecv(chunks[to], dest=to, recvbuf=incoming, source=frm)
                chunks[rank] += incoming
            for s in range(1, p):
                to, frm = (rank + s) % p, (rank - s) % p
                comm.Sendrecv(chunks[rank], dest=to, recvbuf=chunks[frm], source=frm)"""],
                                                            "one neighbour"),
        "Isend waited on before the Recv": Wrong("deadlock", ["""
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Isend(send, dest=right).Wait()
                comm.Recv(incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Isend(send, dest=right).Wait()
                comm.Recv(recv, source=left)"""], "deadlock"),
        "Isends never waited for": Wrong("point", ["""
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                comm.Isend(send.copy(), dest=right)
                comm.Recv(incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                comm.Isend(send.copy(), dest=right)
                comm.Recv(recv, source=left)"""], "never completed"),
        "a communicator duplicated on every call, never freed": Wrong("point", ["""
            ring = comm.Dup()
            chunks = np.array_split(x, p)
            for s in range(p - 1):
                send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
                incoming = np.empty_like(recv)
                ring.Sendrecv(send, dest=right, recvbuf=incoming, source=left)
                recv += incoming
            for s in range(p - 1):
                send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
                ring.Sendrecv(send, dest=right, recvbuf=recv, source=left)"""], "Free()"),
        "ring turning left, saved with FAIL outputs": Wrong(
            "saved", [RING_LEFT], "at 3 ranks", saved("FAIL: at 2 ranks")),
        "the learner cell moved below the checks": Wrong(
            "tampered", [RIGHT], "moved", learner_after_checks),
        "a check cell untagged": Wrong("tampered", [RING_LEFT], "tags", untag_check(2)),
    },
    "04_gloo_bootstrap": {
        "a result that patches the grader when rebuilt": Wrong(
            "tampered", [gloo(ret="Forged(), port")], "not plain data",
            learner_adds("import pickle\n" + SMUGGLED_RESULT)),
        "the source's hard-coded port 29500": Wrong("point", ["""
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
                                    rank=comm.rank, world_size=comm.size,
                                    timeout=timedelta(seconds=timeout_s))
            return "127.0.0.1", 29500"""], "check 1/3"),
        "another fixed port, broadcast over MPI": Wrong("point", ["""
            where = ("127.0.0.1", 29517) if comm.rank == 0 else None
            addr, port = comm.bcast(where, root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                                    world_size=comm.size, timeout=timedelta(seconds=timeout_s))
            return addr, port"""], "operating system"),
        "a random port instead of the OS's": Wrong("point", ["""
            import random
            where = ("127.0.0.1", random.randint(20000, 60000)) if comm.rank == 0 else None
            addr, port = comm.bcast(where, root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                                    world_size=comm.size, timeout=timedelta(seconds=timeout_s))
            return addr, port"""], "operating system"),
        "bind to port 0, close, let torch bind it (the race)": Wrong(
            "point", [GLOO_RACE], "taken between choosing it and listening"),
        "the meeting point 0.0.0.0": Wrong("point", [gloo(host="0.0.0.0")], "0.0.0.0"),
        "the meeting point passed through a file in /tmp": Wrong("point", [GLOO_FILE],
                                                                  "through MPI"),
        "the timeout cut to whole seconds": Wrong(
            "point", [gloo(timeout="timedelta(seconds=int(timeout_s))")], "check 3/3"),
        "a fixed port for the store": Wrong("point", [gloo().replace(
            "'127.0.0.1', 0, comm.size", "'127.0.0.1', 29517, comm.size")], "operating system"),
        "the store opened, then a tcp:// group at its port": Wrong("point", [gloo().replace(
            'store=store,', 'init_method=f"tcp://{addr}:{port}",')], "in use"),
        "the OS's port, its socket left open": Wrong("point", ["""
            if comm.rank == 0:
                held = socket.socket()
                held.bind(("127.0.0.1", 0))
                where = held.getsockname()
            addr, port = comm.bcast(where if comm.rank == 0 else None, root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank,
                                    world_size=comm.size, timeout=timedelta(seconds=timeout_s))
            return addr, port"""], "in use"),
        "(port, address) returned": Wrong("point", [gloo(ret="port, addr")], "(address, port)"),
        "no timeout given": Wrong("point", [gloo(timeout="timedelta(minutes=30)")], "check 3/3"),
        "a fixed timeout of 15 s": Wrong("point", [gloo(timeout="timedelta(seconds=15)")],
                                         "check 3/3"),
        "world_size=2": Wrong("size", [gloo(size="2")], "at 3 ranks"),
        "rank from MPI.COMM_WORLD": Wrong("size", [gloo(rank="MPI.COMM_WORLD.rank")], "check 1/3"),
        "hard-coded port, saved with PASS": Wrong("saved", ["""
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500",
                                    rank=comm.rank, world_size=comm.size,
                                    timeout=timedelta(seconds=timeout_s))
            return "127.0.0.1", 29500"""], "check 1/3", saved("PASS")),
        "mc rebound in the learner's cell": Wrong(
            "tampered", [RIGHT], "rebinds `mc`", learner_adds("mc = None")),
    },
    "05_broadcast_consistency": {
        "broadcast from rank 0 whatever the root": Wrong("point", ["""
            for t in [*model.parameters(), *model.buffers()]:
                comm.Bcast(t.detach().numpy(), root=0)""", RIGHT], "check 2/4"),
        "parameters only, buffers forgotten": Wrong("point", ["""
            for t in model.parameters():
                comm.Bcast(t.detach().numpy(), root=root)""", RIGHT], "running_mean"),
        "broadcast into new tensors": Wrong("point", ["""
            for t in [*model.parameters(), *model.buffers()]:
                t.data = torch.as_tensor(comm.bcast(t.detach().numpy(), root=root))""", RIGHT],
                                            "replaced"),
        "root sends to rank 1 - root (p = 2 only)": Wrong("size", ["""
            for t in [*model.parameters(), *model.buffers()]:
                if comm.rank == root:
                    comm.Send(t.detach().numpy(), dest=1 - root)
                else:
                    comm.Recv(t.detach().numpy(), source=root)""", RIGHT], "check 1/4"),
        "spread of the parameters only": Wrong("point", [RIGHT, """
            spread = 0.0
            for t in model.parameters():
                hi = t.detach().numpy().copy()
                lo = hi.copy()
                comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
                comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
                spread = max(spread, float((hi - lo).max()))
            return spread"""], "check 3/4"),
        "spread reduced in place on the model itself": Wrong("point", [RIGHT, """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                lo = t.detach().numpy().copy()
                comm.Allreduce(MPI.IN_PLACE, t.detach().numpy(), op=MPI.MAX)
                comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
                spread = max(spread, float((t.detach().numpy() - lo).max()))
            return spread"""], "check 4/4"),
        "spread as the distance from rank 0": Wrong("size", [RIGHT, """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                mine = t.detach().numpy()
                root = mine.copy()
                comm.Bcast(root, root=0)
                far = np.abs(mine - root).max() if mine.size else 0.0
                spread = max(spread, comm.allreduce(float(far), op=MPI.MAX))
            return spread"""], "at 3 ranks"),
        "floating-point tensors only": Wrong("point", ["""
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    comm.Bcast(t.detach().numpy(), root=root)""", FLOAT_SPREAD],
            "num_batches_tracked"),
        "spread skips the batch counts": Wrong("point", [RIGHT, FLOAT_SPREAD], "check 3/4"),
        "only the root calls Bcast": Wrong("deadlock", ["""
            for t in [*model.parameters(), *model.buffers()]:
                if comm.rank == root:
                    comm.Bcast(t.detach().numpy(), root=root)""", RIGHT], "check 1/4"),
        "broadcast into t.contiguous().numpy()": Wrong("point", ["""
            for t in [*model.parameters(), *model.buffers()]:
                comm.Bcast(t.detach().contiguous().numpy(), root=root)""", RIGHT], "0.weight"),
        "frozen parameters skipped": Wrong("point", ["""
            for t in [*(q for q in model.parameters() if q.requires_grad), *model.buffers()]:
                comm.Bcast(t.detach().numpy(), root=root)""", RIGHT], "0.bias"),
        "spread rounded to 6 decimals": Wrong("point", [RIGHT, """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                hi = t.detach().numpy().copy()
                lo = hi.copy()
                comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
                comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
                spread = max(spread, float((hi - lo).max()))
            return round(spread, 6)"""], "nearly identical"),
        "spread measured through float32": Wrong("point", [RIGHT, """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                hi = t.detach().float().numpy().copy()
                lo = hi.copy()
                comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
                comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
                spread = max(spread, float((hi - lo).max()))
            return spread"""], "nearly identical"),
        "buffers forgotten, saved with PASS": Wrong("saved", ["""
            for t in model.parameters():
                comm.Bcast(t.detach().numpy(), root=root)""", RIGHT], "running_mean",
                                                    saved("PASS")),
        "max_spread compares each rank only with its ring neighbour": Wrong("size", [RIGHT, """
            spread = 0.0
            for t in [*model.parameters(), *model.buffers()]:
                mine = t.detach().numpy().astype(np.float64)
                left = np.empty_like(mine)
                comm.Sendrecv(mine, dest=(comm.rank + 1) % comm.size, recvbuf=left,
                              source=(comm.rank - 1) % comm.size)
                spread = max(spread, float(np.abs(mine - left).max()))
            return comm.allreduce(spread, op=MPI.MAX)"""], "at 4 ranks"),
        "check replaced in the learner's cell": Wrong(
            "tampered", [UNSOLVED, UNSOLVED], "rebinds `check`",
            learner_adds("def check(mc, i):\n    return None")),
    },
    "06_bucketed_allreduce": {
        "every slice taken at offset 0": Wrong("point", ["""
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            bucket = torch.cat([g.reshape(-1) for g in grads])
            comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
            bucket /= comm.size
            for g in grads:
                g.copy_(bucket[:g.numel()].view_as(g))"""], "check 2/4"),
        "one Allreduce per parameter, no bucket": Wrong("point", ["""
            for p in model.parameters():
                if p.grad is not None:
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= comm.size"""], "check 1/4"),
        "divided by 2": Wrong("size", [BUCKET.format(divisor=2, order="grads")], "at 3 ranks"),
        "crashes on a gradient that is None": Wrong("point", [BUCKET.format(
            divisor="comm.size", order="grads").replace(" if p.grad is not None", "")],
                                                     "check 4/4"),
        "summed but never copied back": Wrong("point", ["""
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            bucket = torch.cat([g.reshape(-1) for g in grads])
            comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
            bucket /= comm.size"""], "check 2/4"),
        "unflattened in reverse order": Wrong("point", [BUCKET.format(
            divisor="comm.size", order="reversed(grads)")], "check 2/4"),
        "zeros for missing gradients, written back": Wrong("point", ["""
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in model.parameters()]
            bucket = torch.cat([g.reshape(-1) for g in grads])
            comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
            bucket /= comm.size
            offset = 0
            for g in grads:
                g.copy_(bucket[offset:offset + g.numel()].view_as(g))
                offset += g.numel()"""], "check 4/4"),
        "a float32 bucket (torch.empty without dtype)": Wrong("point", ["""
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            bucket = torch.empty(sum(g.numel() for g in grads))
            offset = 0
            for g in grads:
                bucket[offset:offset + g.numel()] = g.reshape(-1)
                offset += g.numel()
            comm.Allreduce(MPI.IN_PLACE, bucket.numpy(), op=MPI.SUM)
            bucket /= comm.size
            offset = 0
            for g in grads:
                g.copy_(bucket[offset:offset + g.numel()].view_as(g))
                offset += g.numel()"""], "float32"),
        "flattened with view(-1)": Wrong("point", [BUCKET.format(
            divisor="comm.size", order="grads").replace("g.reshape(-1)", "g.view(-1)")],
            "transposed"),
        "unsolved, saved with PASS under every check": Wrong(
            "saved", [UNSOLVED], "not solved yet", saved("PASS")),
        "a check cell tagged as the learner's": Wrong(
            "tampered", [UNSOLVED], "tags", check_tagged_exercise(0)),
        "a cell added that prints PASS": Wrong(
            "tampered", [UNSOLVED], "added", extra_cell("print('check 1/4 ...: PASS')")),
    },
    "07_parameter_averaging": {
        "summed instead of averaged": Wrong("point", ["""
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)""", RIGHT],
                                            "check 1/3"),
        "averages after steps 0, period, ... (off by one)": Wrong("point", [RIGHT, """
            if step % period == 0:
                average_parameters(model, comm)"""], "check 3/3"),
        "divided by 2": Wrong("size", ["""
            with torch.no_grad():
                for p in model.parameters():
                    comm.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)
                    p /= 2""", RIGHT], "at 3 ranks"),
        "averages once, after the last step": Wrong("point", [RIGHT, """
            if step == steps - 1:
                average_parameters(model, comm)"""], "check 2/3"),
        "new tensors instead of averaging in place": Wrong("point", ["""
            for p in model.parameters():
                total = comm.allreduce(p.detach().numpy(), op=MPI.SUM)
                p.data = torch.as_tensor(total / comm.size)""", RIGHT], "in place"),
        "gradients averaged instead of parameters": Wrong("point", [RIGHT, """
            if (step + 1) % period == 0:
                for p in model.parameters():
                    comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                    p.grad /= comm.size"""], "check 2/3"),
        "MPI.COMM_WORLD instead of the comm given": Wrong("size", ["""
            world = MPI.COMM_WORLD
            with torch.no_grad():
                for p in model.parameters():
                    world.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)
                    p /= world.size""", RIGHT], "check 1/3"),
        "only rank 0 averages": Wrong("deadlock", [RIGHT, """
            if (step + 1) % period == 0 and comm.rank == 0:
                average_parameters(model, comm)"""], "check 2/3"),
        "the state_dict averaged, its integer buffer too": Wrong("point", ["""
            with torch.no_grad():
                for t in model.state_dict().values():
                    comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
                    t.copy_(t / comm.size)""", RIGHT], "buffer"),
        "averaged through a float32 copy": Wrong("point", ["""
            with torch.no_grad():
                for p in model.parameters():
                    buf = p.detach().float().numpy()
                    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                    p.copy_(torch.from_numpy(buf) / comm.size)""", RIGHT], "float32"),
        "a communicator duplicated on every call, never freed": Wrong("point", ["""
            mine = comm.Dup()
            with torch.no_grad():
                for p in model.parameters():
                    mine.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)
                    p /= comm.size""", RIGHT], "Free()"),
        "summed, saved with FAIL outputs": Wrong("saved", ["""
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.detach().numpy(), op=MPI.SUM)""", RIGHT],
                                                 "check 1/3", saved("FAIL: x")),
        "the last check cell deleted": Wrong("tampered", [RIGHT, UNSOLVED], "removed",
                                             drop_check(2)),
        "the checks' reference patched through an import of the course": Wrong(
            "tampered", [RIGHT, RIGHT], "the course's own code", learner_adds(
                "import pcourse.tools.grading.refs.parameter_averaging as _r\n"
                "_r.local_sgd_reference = lambda size, steps, period: None")),
    },
    "08_sharded_optimizer": {
        "slices of n // size, no padding": Wrong("point", ["""
            per = n // size
            return rank * per, (rank + 1) * per, n""", RIGHT], "check 1/3"),
        "the last rank takes the remainder": Wrong("point", ["""
            per = n // size
            return rank * per, n if rank == size - 1 else (rank + 1) * per, n""", RIGHT],
                                                   "check 1/3"),
        "padded length forgotten": Wrong("point", ["""
            per = -(-n // size)
            return rank * per, (rank + 1) * per, n""", RIGHT], "check 1/3"),
        "the next rank's slice": Wrong("size", ["""
            per = -(-n // size)
            r = (rank + 1) % size
            return r * per, (r + 1) * per, per * size""", RIGHT], "check 1/3"),
        "stepping on the full local gradient": Wrong("point", [RIGHT, """
            start = comm.rank * shard.numel()
            shard.grad = flat_grad[start:start + shard.numel()].clone()
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 2/3"),
        "summed, not averaged": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine)
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 2/3"),
        "averaged twice": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size / comm.size)
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 2/3"),
        "the gradient gathered instead of the parameters": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size)
            shard_opt.step()
            comm.Allgather(mine, flat_params.numpy())"""], "check 2/3"),
        "the old slice of flat_params gathered": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size)
            shard_opt.step()
            start = comm.rank * shard.numel()
            own = flat_params[start:start + shard.numel()].numpy().copy()
            comm.Allgather(own, flat_params.numpy())"""], "check 2/3"),
        "gathered before the step": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size)
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())
            shard_opt.step()"""], "check 2/3"),
        "allreduce of the whole gradient, then my slice": Wrong("point", [RIGHT, """
            comm.Allreduce(MPI.IN_PLACE, flat_grad.numpy(), op=MPI.SUM)
            start = comm.rank * shard.numel()
            shard.grad = flat_grad[start:start + shard.numel()] / comm.size
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""],
            "Reduce_scatter_block"),
        "the optimizer's state dropped every step": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel())
            comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size)
            shard_opt.state.clear()
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 3/3"),
        "a communicator duplicated on every step, never freed": Wrong("point", [RIGHT, """
            mine_comm = comm.Dup()
            mine = np.empty(shard.numel())
            mine_comm.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size)
            shard_opt.step()
            mine_comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "Free()"),
        "reduce-scattered through float32": Wrong("point", [RIGHT, """
            mine = np.empty(shard.numel(), dtype=np.float32)
            comm.Reduce_scatter_block(flat_grad.float().numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / comm.size).double()
            shard_opt.step()
            comm.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 3/3"),
        "MPI.COMM_WORLD instead of the comm given": Wrong("size", [RIGHT, """
            world = MPI.COMM_WORLD
            mine = np.empty(shard.numel())
            world.Reduce_scatter_block(flat_grad.numpy(), mine, op=MPI.SUM)
            shard.grad = torch.from_numpy(mine / world.size)
            shard_opt.step()
            world.Allgather(shard.detach().numpy(), flat_params.numpy())"""], "check 2/3"),
        "the last check cell deleted": Wrong("tampered", [RIGHT, UNSOLVED], "removed",
                                             drop_check(2)),
    },
    "09_tensor_parallel": {
        # regions: f's forward, f's backward, g's forward, g's backward, column_block,
        # row_block, column_parallel_linear, row_parallel_linear
        "f's backward allreduce forgotten": Wrong("point", [
            RIGHT, "return grad, None", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT],
            "this rank's own gradient only"),
        "f sums in both directions": Wrong("point", [
            """
            ctx.group = group
            return group.allreduce(x.clone(), "sum")""", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT,
            RIGHT, RIGHT], "going forward f is the identity"),
        "g sums in both directions": Wrong("point", [
            RIGHT, RIGHT, """
            ctx.group = group
            return group.allreduce(x.clone(), "sum")""",
            'return ctx.group.allreduce(grad.clone(), "sum"), None', RIGHT, RIGHT, RIGHT, RIGHT],
            "going backward g is the identity"),
        "g averages instead of summing": Wrong("point", [
            RIGHT, RIGHT, 'return group.allreduce(x.clone(), "avg")', RIGHT, RIGHT, RIGHT, RIGHT,
            RIGHT], "0.5 times"),
        "the world instead of the group given": Wrong("point", [
            RIGHT, """
            from mpi4py import MPI
            total = grad.clone()
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
            return total, None""", """
            from mpi4py import MPI
            total = x.clone()
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
            return total""", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT], "sum over all 4 ranks"),
        "column-parallel weight split by its input features": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, """
            n = weight.shape[0] // group.size
            block = slice(group.rank * n, (group.rank + 1) * n)
            return weight[:, block], bias[block]""", RIGHT, RIGHT, RIGHT],
            "column_block's weight has shape"),
        "row-parallel weight split by its output features": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, """
            n = weight.shape[1] // group.size
            return weight[group.rank * n:(group.rank + 1) * n], bias""", RIGHT, RIGHT],
            "row_block's weight has shape"),
        "row-parallel bias split too": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, """
            n = weight.shape[1] // group.size
            block = slice(group.rank * n, (group.rank + 1) * n)
            return weight[:, block], bias[block]""", RIGHT, RIGHT], "row_block's bias"),
        "the bias added on every rank": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT,
            "return g(F.linear(x, weight, bias), group)"], "added 2 times"),
        "blocks of a hard-coded 2 ranks": Wrong("size", [
            RIGHT, RIGHT, RIGHT, RIGHT, """
            n = weight.shape[0] // 2
            rows = slice(group.rank * n, (group.rank + 1) * n)
            return weight[rows], bias[rows]""",
            """
            n = weight.shape[1] // 2
            return weight[:, group.rank * n:(group.rank + 1) * n], bias""", RIGHT, RIGHT],
            "at tp=3"),
        "right only in the forward: the sum taken outside autograd": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, """
            total = F.linear(x, weight).detach().clone()
            group.allreduce(total, "sum")
            return total + bias"""], "no gradient reached the input x"),
        "f left out of the column-parallel layer": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, "return F.linear(x, weight, bias)", RIGHT],
            "this rank's own part only"),
        "f and g swapped in the layers": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, "return F.linear(g(x, group), weight, bias)",
            "return f(F.linear(x, weight), group) + bias"], "check 3/5"),
        "the block taken by the world's rank": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, """
            from mpi4py import MPI
            n = weight.shape[0] // group.size
            r = MPI.COMM_WORLD.rank % group.size
            return weight[r * n:(r + 1) * n], bias[r * n:(r + 1) * n]""", RIGHT, RIGHT, RIGHT],
            "check 1/5"),
        "only the group's rank 0 sums": Wrong("deadlock", [
            RIGHT, RIGHT, """
            if group.rank == 0:
                group.allreduce(x.clone(), "sum")
            return x.clone()""", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT], "check 2/5"),
        # issue 55: what the checks of one float64 shape, one group and fresh tensors let by
        "f's backward sums the gradient it is handed, in place": Wrong("point", [
            RIGHT, 'return ctx.group.allreduce(grad, "sum"), None', RIGHT, RIGHT, RIGHT, RIGHT,
            RIGHT, RIGHT], "changed the gradient it was handed in place"),
        "g's forward sums its input in place": Wrong("point", [
            RIGHT, RIGHT, 'return group.allreduce(x, "sum")', RIGHT, RIGHT, RIGHT, RIGHT, RIGHT],
            "changed the caller's input in place"),
        "g returns a float64 copy": Wrong("point", [
            RIGHT, RIGHT, 'return group.allreduce(x.to(torch.float64, copy=True), "sum")', RIGHT,
            RIGHT, RIGHT, RIGHT, RIGHT], "returned float64 for a float32 input"),
        "the group kept in a module global, set by f's forward": Wrong("point", [
            """
            global GROUP
            GROUP = group
            return x.view_as(x)""", 'return GROUP.allreduce(grad.clone(), "sum"), None', RIGHT,
            RIGHT, RIGHT, RIGHT, RIGHT, RIGHT], "never in a module global"),
        "blocks cut with the exercise's hidden size hard-coded": Wrong("point", [
            RIGHT, RIGHT, RIGHT, RIGHT, """
            n = 12 // group.size
            rows = slice(group.rank * n, (group.rank + 1) * n)
            return weight[rows], bias[rows]""", """
            n = 12 // group.size
            return weight[:, group.rank * n:(group.rank + 1) * n], bias""", RIGHT, RIGHT],
            "hard-coded"),
        "f's backward forgotten, saved with PASS": Wrong("saved", [
            RIGHT, "return grad, None", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT],
            "f's backward", saved("PASS")),
        "f's backward forgotten, the checks' diagnosis patched in the learner's process": Wrong(
            "tampered", [RIGHT, "return grad, None", RIGHT, RIGHT, RIGHT, RIGHT, RIGHT, RIGHT],
            "this rank's own gradient only", learner_adds(
                "import os\n_tp = os.sys.modules['pcourse.tools.grading.refs.tensor_parallel']\n"
                "_tp.fg_problem = lambda *a, **k: None\n_tp.fg_reference = lambda tp, n: None")),
    },
    "10_pipeline_schedule": {
        # regions: one_f_one_b's body, run_stage's body
        "GPipe's order called 1F1B": Wrong("point", [PIPE_GPIPE, RIGHT], "GPipe's order"),
        "a warm-up one forward too long": Wrong("point", [pipe_order("min(p - rank, m)"), RIGHT],
                                                 "forwards before its first backward"),
        "the warm-up counted from the wrong end": Wrong("point", [pipe_order("min(rank, m)"),
                                                                  RIGHT], "a warm-up of"),
        "the cool-down forgotten": Wrong("point", [pipe_order(cool_down=False), RIGHT],
                                         "never goes backward"),
        "a warm-up of a hard-coded 2 stages": Wrong("size", [pipe_order("max(min(1 - rank, m), 0)"),
                                                             RIGHT], "at p=3"),
        "the last stage sends gradients forward": Wrong("point", [RIGHT, pipe_loop(
            "group.send(x.grad, rank - 1, i)", "group.send(x.grad, rank + 1, i)")],
            "gradients back to rank - 1"),
        "gradients not accumulated across micro-batches": Wrong("point", [RIGHT, pipe_loop(
            "x, y = kept.pop(i)", "x, y = kept.pop(i)\n            stage.zero_grad()")],
            "last micro-batch's gradient alone"),
        "the loss divided by p instead of m": Wrong("point", [RIGHT, pipe_loop(
            "(y * targets[i]).sum() / m", "(y * targets[i]).sum() / group.size")],
            "divided by the number of stages p"),
        "the loss not divided at all": Wrong("point", [RIGHT, pipe_loop(
            "(y * targets[i]).sum() / m", "(y * targets[i]).sum()")], "not their mean"),
        "every stage receives first, the first from the last: a ring": Wrong("deadlock", [
            RIGHT, pipe_loop("x = inputs[i] if first else group.recv(rank - 1, i).requires_grad_()",
                             "x = group.recv((rank - 1) % group.size, i).requires_grad_()")],
            "a deadlock"),
        "the loop runs its own GPipe order, not the one given": Wrong("point", [RIGHT, pipe_loop(
            "for action, i in order:",
            'for action, i in [("F", k) for k in range(m)] + [("B", k) for k in range(m)]:')],
            "must follow the order it is given"),
        "the received activation not marked requires_grad_": Wrong("point", [RIGHT, pipe_loop(
            "group.recv(rank - 1, i).requires_grad_()", "group.recv(rank - 1, i)")],
            "requires_grad_()"),
        "the last stage is rank 1 (right only at p = 2)": Wrong("size", [RIGHT, pipe_loop(
            "first, last = rank == 0, rank == group.size - 1",
            "first, last = rank == 0, rank == 1")],
            "at 3 ranks"),
        # issue 55: what 1F1B's order alone, fresh gradients and float64 let by
        "each backward paired with the oldest forward kept": Wrong("point", [
            RIGHT, pipe_loop_swaps(("kept = {}", "kept = []"),
                                   ("kept[i] = (x, y)", "kept.append((x, y))"),
                                   ("x, y = kept.pop(i)", "x, y = kept.pop(0)"))],
            "pair each ('B', i) with micro-batch i's own forward"),
        "activations kept in a ring of p slots": Wrong("point", [
            RIGHT, pipe_loop_swaps(("kept[i] = (x, y)", "kept[i % group.size] = (x, y)"),
                                   ("x, y = kept.pop(i)", "x, y = kept[i % group.size]"))],
            "GPipe's order (8 micro-batches in flight)"),
        "stage.zero_grad() at the start": Wrong("point", [
            RIGHT, pipe_loop("kept = {}", "kept = {}\n    stage.zero_grad()")],
            "the gradients the stage held before run_stage were lost"),
        "GPipe's order, saved with PASS": Wrong("saved", [PIPE_GPIPE, RIGHT], "GPipe's order",
                                                saved("PASS")),
        "GPipe's order, pickle.dumps made to send back a payload that runs code": Wrong(
            "tampered", [PIPE_GPIPE, RIGHT], "GPipe's order",
            learner_adds(pickling_payload("pickle", "pickle.dumps"))),
        "GPipe's order, the wire's dumps made to send back a payload that runs code": Wrong(
            "tampered", [PIPE_GPIPE, RIGHT], "not data",
            learner_adds(pickling_payload("pcourse.tools.grading.wire", "the wire's dumps"))),
        "mc rebound in the learner's cell": Wrong(
            "tampered", [RIGHT, RIGHT], "rebinds `mc`", learner_adds("mc = None")),
    },
    "11_predict_memory_and_time": {
        # regions: collective_time, predict_dp, predict_zero1, predict_tp, predict_1f1b
        "an allreduce's bytes counted once, 2(p - 1)/p forgotten (right at p = 2)": Wrong(
            "size", predict(0, '"allreduce": (2 * (p - 1), 2 * (p - 1) / p)',
                            '"allreduce": (2 * (p - 1), 1)'), "at p=3: 1·n bytes"),
        "the per-call overhead forgotten": Wrong("point", predict(
            0, "return c.overhead + steps", "return steps"), "the per-call overhead counted 0"),
        "AdamW's state counted once per parameter": Wrong("point", predict(
            1, '"optimizer": 2 * psi * s', '"optimizer": psi * s'), "two numbers per parameter"),
        "ZeRO-1 shards the gradients too": Wrong("point", predict(
            2, '"gradients": full * s', '"gradients": mine * s'),
            "sharding the gradients is ZeRO-2"),
        "tensor parallelism leaves the weights whole": Wrong("point", predict(
            3, 'psi = L * ((model["block_params"] - whole) // t + whole)',
            'psi = L * model["block_params"]'), "divides each block's weights by t"),
        "1F1B's activations counted for every micro-batch, m in flight": Wrong("point", predict(
            4, "k = min(p - rank, m)", "k = m"), "min(p - rank, m) micro-batches in flight"),
        "the pipeline's bubble forgotten": Wrong("point", predict(
            4, "(m - 1) * max(stage) + sum(stage)", "m * max(stage)"), "the bubble"),
    },
    "12_resume_exactly": {
        "the generator not restored": Wrong("point", resume(load=[
            ('run.gen.set_state(state["generator"])\n', "")]), "run.gen's state"),
        "the sampler restarting its epoch (the batch lost)": Wrong("point", resume(load=[
            ('run.sampler.epoch, run.sampler.batch = state["epoch"], state["batch"]',
             'run.sampler.epoch = state["epoch"]')]), "run.sampler.batch"),
        "the optimizer's step count lost (the moments kept)": Wrong("point", resume(load=[
            ('run.opt.load_state_dict(state["optimizer"])',
             'saved = state["optimizer"]["state"][0]\nrun.opt.state[run.shard] = {'
             '"step": torch.tensor(0.0), "exp_avg": saved["exp_avg"], '
             '"exp_avg_sq": saved["exp_avg_sq"]}')]), "the optimizer's step count"),
        "written in place, not under a temporary name and renamed": Wrong("point", resume(save=[
            ("torch.save(state, partial)", "torch.save(state, path)"),
            ("fd = os.open(partial, os.O_RDONLY)", "fd = os.open(path, os.O_RDONLY)"),
            ("os.replace(partial, path)  # atomic: the name holds the old file or the whole new "
             "one", "")]), "a checkpoint is complete, or ignored"),
        "only rank 0's shard saved": Wrong("point", resume(save=[
            ('state = {"step"', 'if run.rank != 0:\n    return\nstate = {"step"')]),
            "a save that returns has saved"),
        "each rank resumes from its own newest checkpoint": Wrong("point", resume(load=[
            ("common = mine.intersection(*comm.allgather(sorted(mine)))", "common = mine")]),
            "resumed from different checkpoints"),
        "one file a rank, replaced by each save: the one before it gone": Wrong(
            "point", resume(save=[('f"step-{run.step:08d}.pt"', '"step-00000000.pt"')], load=[
                ('mine = {int(p.name[5:13]) for p in Path(folder).glob("step-*.pt")}',
                 'only = Path(folder) / "step-00000000.pt"\nmine = {torch.load(only, '
                 'weights_only=True)["step"]} if only.exists() else set()'),
                ('Path(folder) / f"step-{step:08d}.pt"', "only")]), "load returned step 0"),
        "run.shard bound to the loaded tensor, not copied into": Wrong("point", resume(load=[
            ('with torch.no_grad():\n    run.shard.copy_(state["shard"])',
             'run.shard = state["shard"]')]), "run.opt steps run.shard itself"),
        "the other ranks' slices not gathered into run.params": Wrong("point", resume(load=[
            ("comm.Allgather(run.shard.numpy(), run.params.numpy())", "")]), "run.params"),
        "the losses not restored": Wrong("point", resume(load=[
            ('run.losses[:] = state["losses"]\n', "")]), "run.losses"),
        "the newest step agreed with one neighbour only (right at 2 ranks)": Wrong(
            "size", resume(load=[("common = mine.intersection(*comm.allgather(sorted(mine)))",
                                  "right = comm.sendrecv(sorted(mine), (comm.rank - 1) % "
                                  "comm.size, source=(comm.rank + 1) % comm.size)\n"
                                  "common = mine.intersection(right)")]), "at 3 ranks"),
    },
}

KINDS = ("size", "point", "deadlock", "saved", "tampered")
