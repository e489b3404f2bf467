"""Exercise 12's checks (pcourse.tools.grading.refs.resume_exactly), in one process.

What the grader relies on and no grading of a notebook shows alone: the reference run is
ZeRO-1 (one AdamW on the ranks' mean gradient, computed here another way: an nn.Module,
the batches and masks drawn again); a "full disk" tears a file and the process lives on;
every part of the state a resume reads is named when it differs; every step a check may
draw shows each lost part. The wrong answers themselves are graded in tests/test_grading.py.
"""

from __future__ import annotations

import torch

from pcourse.tools.grading.refs import resume_exactly as ex
from pcourse.tools.grading.refs.common import make_data, shard_of


def _independent(case: ex.Case, size: int) -> tuple[list[torch.Tensor], list[list[float]]]:
    """One process, one AdamW over the whole (unpadded) parameters, the gradient the mean of
    every rank's (an nn.Sequential, its batch and dropout mask drawn here): the parameters
    after each step, and each rank's losses."""
    h, dtype = case.hidden, case.dtype
    flat = ex.Run(case, 0, size).params[:case.n()].clone()  # the run's start, its only input
    w1, b1 = flat[:3 * h].view(h, 3), flat[3 * h:4 * h]
    w2, b2 = flat[4 * h:6 * h].view(2, h), flat[6 * h:]
    first, second = torch.nn.Linear(3, h).to(dtype), torch.nn.Linear(h, 2).to(dtype)
    with torch.no_grad():
        for layer, w, b in ((first, w1, b1), (second, w2, b2)):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    params = [first.weight, first.bias, second.weight, second.bias]
    opt = torch.optim.AdamW(params, lr=ex.LR, weight_decay=ex.DECAY)
    gens = [torch.Generator().manual_seed(1000 + r) for r in range(size)]
    data = [shard_of(make_data(ex.LOCAL * size, seed=3), r, size) for r in range(size)]
    per_epoch = ex.LOCAL // ex.BATCH
    after, losses = [], [[] for _ in range(size)]
    for step in range(ex.STEPS):
        epoch, batch = divmod(step, per_epoch)
        opt.zero_grad()
        for r in range(size):
            order = torch.randperm(ex.LOCAL, generator=torch.Generator().manual_seed(
                100 + r + epoch))
            idx = order[batch * ex.BATCH:(batch + 1) * ex.BATCH]
            x, y = (t.to(dtype)[idx] for t in data[r])
            mask = (torch.rand(ex.BATCH, h, generator=gens[r], dtype=dtype) >= ex.DROP)
            hidden = torch.tanh(first(x)) * mask.to(dtype) / (1 - ex.DROP)
            loss = torch.nn.functional.mse_loss(second(hidden), y)
            (loss / size).backward()
            losses[r].append(loss.item())
        opt.step()
        after.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return after, losses


def test_the_reference_is_one_adamw_on_the_mean_gradient_of_every_rank():
    for case in ex.CASES:
        for size in (2, 3):
            ref = ex.uninterrupted(case, size)
            after, losses = _independent(case, size)
            tol = {torch.float64: 1e-12, torch.float32: 1e-5}[case.dtype]
            for step in range(1, ex.STEPS + 1):
                for r in range(size):
                    got = ref[r][step]["params"][:case.n()]
                    assert torch.allclose(got, after[step - 1], rtol=tol, atol=tol), (case, size,
                                                                                      step, r)
            for r in range(size):
                assert torch.allclose(torch.tensor(ref[r][-1]["losses"]),
                                      torch.tensor(losses[r]), rtol=tol, atol=tol)
                assert ref[r][-1]["opt_step"] == ex.STEPS


def test_a_full_disk_tears_the_file_and_the_process_goes_on(tmp_path):
    state = {"x": torch.arange(1000, dtype=torch.float64)}
    torn = tmp_path / "torn.pt"
    error = ex.full_disk(torch.save, state, torn)
    assert error is not None and torn.stat().st_size == ex.TORN_BYTES
    whole = tmp_path / "whole.pt"
    torch.save(state, whole)  # the limit is lifted again, and no signal was left pending
    assert torch.equal(torch.load(whole, weights_only=True)["x"], state["x"])


def test_every_part_a_resume_reads_is_named_where_it_differs():
    want = ex.uninterrupted(ex.CASES[0], 2)[0][4]
    assert ex.differs(dict(want), want, "here") is None
    for key, what, _ in ex.PARTS:
        got = dict(want)
        value = got[key]
        if isinstance(value, torch.Tensor):
            got[key] = value.clone()
            got[key].view(-1)[-1] += 1
        elif isinstance(value, bool):
            got[key] = not value
        elif isinstance(value, list):
            got[key] = value[:-1]
        else:
            got[key] = value + 1
        said = ex.differs(got, want, "here")
        assert said is not None and what in said, (key, said)


def test_every_step_a_check_draws_shows_each_lost_part():
    per_epoch = ex.LOCAL // ex.BATCH
    for size in (2, 3, 4):
        steps = ex.resumable(size)
        assert len(steps) >= 2  # check 3 draws two
        for k in steps:
            assert k % ex.EVERY == 0 and k % per_epoch and k // per_epoch >= 1
            assert k + ex.EVERY <= ex.STEPS  # a save after it, to tear
        for how in ("killed", "torn", "twice"):
            for _ in range(20):
                deaths, expected = ex._draw(size, how)
                assert expected[0] == 0 and len(expected) == len(deaths) + 1
                nexts = expected[2:] + [None]
                for (die_at, torn_rank), k, after in zip(deaths, expected[1:], nexts, strict=True):
                    assert die_at is not None
                    if torn_rank is None:
                        assert k < die_at <= k + ex.EVERY
                    else:
                        assert die_at == k + ex.EVERY and 0 <= torn_rank < size
                    assert after is None or after > k
