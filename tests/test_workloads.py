"""The workloads (Franke, MNIST VAE), the training loop and the scaling benchmark.

The central check: strong scaling makes the same updates at any rank count, so the
1-, 2- and 4-rank runs of every CPU backend end with the serial run's weights and
losses. References are independent: closed forms, the raw IDX bytes, a serial
single-process run.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pcourse.loop import batch_sizes, local_batches, train
from pcourse.tools.bench import scaling as bench
from pcourse.tools.cluster.launch import mpirun
from pcourse.workloads import mnist
from pcourse.workloads.franke import (
    DOMAIN,
    DOMAIN_AS_IN_SOURCE,
    FrankeConfig,
    franke,
    franke_as_in_source,
    make_data,
)
from pcourse.workloads.vae import (
    VAE,
    MNISTConfig,
    latent_walk_figure,
    make_workload,
    reconstruction_figure,
    vae_loss,
)

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "tests" / "mpi" / "check_scaling.py"
MNIST_DIR = Path(os.environ.get(mnist.ENV_VAR) or REPO.parent / "shared" / "data" / "mnist")
HAVE_MNIST = (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file()
needs_mnist = pytest.mark.skipif(not HAVE_MNIST, reason=f"no MNIST test split in {MNIST_DIR}")

# Small enough for 2 cores, long enough (24 Adam steps) for a wrong update to show.
# float64: the ranks sum gradients in another order than the serial run, and Adam
# divides by sqrt(v), which blows float32 rounding up to ~1e-5 in a few weights;
# in float64 the same runs agree to ~1e-15, so the tolerance can be tight.
FRANKE = FrankeConfig.quick(epochs=3, dtype="float64")
MNIST = MNISTConfig.quick(limit=512, epochs=1, batch_size=64, scaling="strong",
                          data_dir=str(MNIST_DIR), dtype="float64")
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(autouse=True)
def offline_mnist(monkeypatch):
    monkeypatch.setenv(mnist.DOWNLOAD_VAR, "0")  # a missing file must fail fast, not download


# ---------------------------------------------------------------- Franke
def franke_scalar(x: float, y: float) -> float:
    """The four terms written out again, in scalar math: the closed form."""
    return (0.75 * math.exp(-((9 * x - 2) ** 2) / 4 - ((9 * y - 2) ** 2) / 4)
            + 0.75 * math.exp(-((9 * x + 1) ** 2) / 49 - (9 * y + 1) / 10)
            + 0.5 * math.exp(-((9 * x - 7) ** 2) / 4 - ((9 * y - 3) ** 2) / 4)
            - 0.2 * math.exp(-((9 * x - 4) ** 2) - (9 * y - 7) ** 2))


def test_franke_closed_form():
    points = [(0.0, 0.0), (1.0, 1.0), (2 / 9, 2 / 9), (-1.0, 0.5), (0.3, -0.7)]
    xs, ys = (torch.tensor(c, dtype=torch.float64) for c in zip(*points, strict=True))
    got = franke(xs, ys)
    for (x, y), value in zip(points, got, strict=True):
        assert value.item() == pytest.approx(franke_scalar(x, y), rel=1e-12)
    assert got[0].item() == pytest.approx(0.75 * math.exp(-2) + 0.75 * math.exp(-1 / 49 - 0.1),
                                          rel=1e-6)


def test_the_source_variant_squares_only_the_second_terms_y():
    """Equal where (9y+1)/10 == (9y+1)²/10, i.e. 9y+1 in {0, 1}; different elsewhere."""
    x = torch.tensor([0.3, -0.5, 0.9], dtype=torch.float64)
    for y_value, equal in [(-1 / 9, True), (0.0, True), (0.5, False), (-0.8, False)]:
        y = torch.full_like(x, y_value)
        same = torch.allclose(franke_as_in_source(x, y), franke(x, y), rtol=1e-12, atol=0)
        assert same == equal, y_value
    y = torch.full_like(x, 0.5)  # 9y+1 = 5.5: exp(-0.55) in the original, exp(-3.025) squared
    diff = franke(x, y) - franke_as_in_source(x, y)
    want = 0.75 * torch.exp(-((9 * x + 1) ** 2) / 49) * (math.exp(-0.55) - math.exp(-3.025))
    assert torch.allclose(diff, want, rtol=1e-12)


def test_franke_data_is_seeded_and_on_frankes_domain():
    x, y = make_data(1000, seed=7)
    assert DOMAIN == (0.0, 1.0)  # Franke's [0, 1]², not the source's [-1, 1]²
    assert x.shape == (1000, 2) and y.shape == (1000, 1)
    assert x.min() >= 0 and x.max() <= 1 and x.min() < 0.01 and x.max() > 0.99
    wide = make_data(1000, seed=7, domain=DOMAIN_AS_IN_SOURCE)[0]
    assert wide.min() < -0.9 and wide.max() > 0.9
    assert torch.equal(make_data(1000, seed=7)[0], x)
    assert not torch.equal(make_data(1000, seed=8)[0], x)
    torch.testing.assert_close(y[:, 0], franke(x[:, 0].double(), x[:, 1].double()).float())


# ---------------------------------------------------------------- MNIST loader
@needs_mnist
def test_mnist_test_split_loads():
    x, labels = mnist.load_mnist("test", MNIST_DIR)
    assert x.shape == (10_000, 784) and x.dtype == torch.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]  # the well-known first test digits
    raw = gzip.decompress((MNIST_DIR / "t10k-images-idx3-ubyte.gz").read_bytes())
    pixels = np.frombuffer(raw[16:16 + 784], dtype=np.uint8)
    np.testing.assert_array_equal((x[0] * 255).round().numpy().astype(np.uint8), pixels)


@needs_mnist
def test_mnist_raw_files_and_env_var(tmp_path, monkeypatch):
    for name in mnist.FILES["test"]:
        (tmp_path / name).write_bytes(gzip.decompress((MNIST_DIR / f"{name}.gz").read_bytes()))
    monkeypatch.setenv(mnist.ENV_VAR, str(tmp_path))
    assert mnist.resolve_dir() == tmp_path
    x, labels = mnist.load_mnist("test", limit=100)
    ref_x, ref_labels = mnist.load_mnist("test", MNIST_DIR, limit=100)
    assert torch.equal(x, ref_x) and torch.equal(labels, ref_labels)


def _copy_split(src: Path, dst: Path) -> None:
    for name in mnist.FILES["test"]:
        (dst / f"{name}.gz").write_bytes((src / f"{name}.gz").read_bytes())


@needs_mnist
@pytest.mark.parametrize("damage", ["cut gzip", "cut raw", "magic"])
def test_mnist_damaged_file_is_refused(tmp_path, damage):
    _copy_split(MNIST_DIR, tmp_path)
    images = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(images.read_bytes())
    if damage == "cut gzip":
        images.write_bytes(images.read_bytes()[:50_000])
    elif damage == "cut raw":
        images.unlink()
        (tmp_path / "t10k-images-idx3-ubyte").write_bytes(raw[:-784])
    else:
        images.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + raw[4:]))
    with pytest.raises(mnist.MNISTError, match="truncated|magic") as err:
        mnist.load_mnist("test", tmp_path)
    assert "t10k-images-idx3-ubyte" in str(err.value)


@needs_mnist
@pytest.mark.parametrize(("split", "limit"), [("test", 500), ("test", None)])
def test_mnist_held_out_images_are_never_trained_on(split, limit):
    """Quick mode trains on the test split: the held-out images must not be among them."""
    (x, labels), (held, held_labels) = mnist.train_and_held_out(split, MNIST_DIR, limit=limit,
                                                                n_eval=300)
    full, full_labels = mnist.load_mnist("test", MNIST_DIR)
    assert torch.equal(held, full[:300]) and torch.equal(held_labels, full_labels[:300])
    assert len(x) == (limit or len(full) - 300)
    assert torch.equal(x, full[300:300 + len(x)])  # the images right after the held-out ones
    # no training image equals any held-out image (MNIST has no exact duplicates here)
    train_rows = {bytes(row.numpy()) for row in (x * 255).to(torch.uint8)}
    assert not any(bytes(row.numpy()) in train_rows for row in (held * 255).to(torch.uint8))


@needs_mnist
def test_vae_evaluates_on_the_held_out_images():
    """evaluate() is the loss of the held-out images, not of the training images."""
    config = dataclasses.replace(MNIST, n_eval=200)
    wl = make_workload(config)
    (x, _), (held, _) = mnist.train_and_held_out(config.split, MNIST_DIR, limit=config.limit,
                                                 n_eval=200)
    model = wl.model.double().eval()

    def loss_of(images):
        images = images.double()
        logits, mu, logvar = model(images, torch.zeros(len(images), config.latent,
                                                       dtype=torch.float64))
        return vae_loss(logits, images, mu, logvar).item()

    assert wl.n_train == len(x)
    assert wl.evaluate(model) == pytest.approx(loss_of(held), rel=1e-12)
    assert wl.evaluate(model) != pytest.approx(loss_of(x[:200]), rel=1e-6)


@pytest.mark.parametrize("n_eval", [0, 10_000])
def test_mnist_held_out_count_is_checked(n_eval):
    with pytest.raises(ValueError, match="n_eval"):
        mnist.train_and_held_out("test", limit=10, n_eval=n_eval)


def test_mnist_missing_file_names_file_folder_and_fix(tmp_path):
    with pytest.raises(mnist.MNISTError) as err:
        mnist.load_mnist("test", tmp_path)
    msg = str(err.value)
    assert "t10k-images-idx3-ubyte" in msg and str(tmp_path) in msg and mnist.ENV_VAR in msg


def test_mnist_unreachable_mirror_is_a_clear_error(tmp_path):
    with pytest.raises(mnist.MNISTError, match="could not be downloaded"):
        mnist.load_mnist("test", tmp_path, allow_download=True,
                         mirrors=("http://127.0.0.1:9/",), timeout=5)
    assert not list(tmp_path.iterdir())  # nothing half-written


# ---------------------------------------------------------------- VAE
def test_vae_shapes_and_loss_against_closed_form():
    torch.manual_seed(0)
    model = VAE(latent=3)
    x = torch.rand(5, 784)
    logits, mu, logvar = model(x, torch.zeros(5, 3))
    assert logits.shape == (5, 784) and mu.shape == logvar.shape == (5, 3)
    p = torch.sigmoid(logits).double()
    bce = -(x * p.log() + (1 - x) * (1 - p).log()).sum(dim=1)
    kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(dim=1)
    expected = (bce + kl).mean().item()
    assert vae_loss(logits, x, mu, logvar).item() == pytest.approx(expected, rel=1e-5)
    assert vae_loss(logits, x, mu, logvar, "sum").item() == pytest.approx(5 * expected, rel=1e-5)


def test_vae_pictures():
    model = VAE()
    assert len(reconstruction_figure(model, torch.rand(4, 784), n=4).axes) == 8
    assert len(latent_walk_figure(model, n=5).axes) == 1


# ---------------------------------------------------------------- the training loop
def test_strided_batches_union_is_the_serial_batch():
    serial = local_batches(100, 0, 1, 16, seed=3, epoch=2)
    shares = [local_batches(100, r, 4, 4, seed=3, epoch=2) for r in range(4)]
    assert len(serial) == len(shares[0])
    for k, batch in enumerate(serial):
        together = torch.cat([s[k] for s in shares])
        assert sorted(together.tolist()) == sorted(batch.tolist())


def test_batch_sizes_and_bad_configurations():
    assert batch_sizes("strong", 256, 4, 10_000) == (64, 256)
    assert batch_sizes("weak", 256, 4, 10_000) == (256, 1024)
    with pytest.raises(ValueError, match="divisible"):
        batch_sizes("strong", 10, 4, 100)
    with pytest.raises(ValueError, match="fewer ranks"):
        batch_sizes("weak", 1, 4, 3)
    with pytest.raises(ValueError, match="scaling"):
        batch_sizes("sideways", 1, 1, 3)


def test_serial_training_learns():
    result = train("franke", None, FrankeConfig.quick(epochs=4), progress=False)
    assert result.ranks == 1 and len(result.epoch_times) == 4
    assert result.losses[-1] < result.losses[0] / 2


@pytest.fixture(scope="module")
def serial_reference():
    """Serial, one-process runs: the reference every parallel run must reproduce."""
    refs = {}
    for name, config in (("franke", FRANKE), ("mnist", MNIST)):
        if name == "mnist" and not HAVE_MNIST:
            continue
        result = train(name, None, config, progress=False)
        weights = torch.cat([p.detach().flatten() for p in result.model.parameters()])
        refs[name] = {"losses": result.losses, "test_loss": result.test_loss, "weights": weights}
    return refs


def _parallel_run(tmp_path, workload, config, backend, ranks, sync="auto"):
    out = tmp_path / f"{workload}-{backend}-{ranks}-{sync}.pt"
    mpirun(ranks, [str(CHECK), workload, backend, str(out),
                   json.dumps(dataclasses.asdict(config)), sync], timeout=180)
    return torch.load(out)


def _assert_same_run(got, ref, label):
    assert got["max_deviation"] == 0.0, f"{label}: ranks disagree by {got['max_deviation']}"
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL, err_msg=label)
    np.testing.assert_allclose(got["test_loss"], ref["test_loss"], rtol=RTOL, err_msg=label)
    torch.testing.assert_close(got["weights"], ref["weights"], rtol=RTOL, atol=ATOL, msg=label)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "mpi-pickle", "gloo"])
def test_strong_scaling_matches_the_serial_run(tmp_path, serial_reference, backend):
    for ranks in (1, 2, 4):
        got = _parallel_run(tmp_path, "franke", FRANKE, backend, ranks)
        _assert_same_run(got, serial_reference["franke"], f"franke {backend} ×{ranks}")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("sync", ["flat", "per-parameter", "bucketed"])
def test_every_gradient_sync_matches_the_serial_run(tmp_path, serial_reference, sync):
    """"auto" picks one per backend (above); each can also be asked for by name."""
    got = _parallel_run(tmp_path, "franke", FRANKE, "mpi", 2, sync)
    _assert_same_run(got, serial_reference["franke"], f"franke mpi ×2, sync={sync}")


@needs_mnist
@pytest.mark.slow
@pytest.mark.mpi
def test_vae_strong_scaling_matches_the_serial_run(tmp_path, serial_reference):
    got = _parallel_run(tmp_path, "mnist", MNIST, "mpi", 2)
    _assert_same_run(got, serial_reference["mnist"], "mnist mpi ×2")


def test_a_wrong_update_is_caught(serial_reference):
    """The comparison can fail: another global batch (as in weak scaling) does not match."""
    result = train("franke", None, dataclasses.replace(FRANKE, batch_size=32), progress=False)
    assert not np.allclose(result.losses, serial_reference["franke"]["losses"], rtol=1e-3)


# ---------------------------------------------------------------- the benchmark command
def _bench_fails(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["franke", "--backends", "mpi", "carrier-pigeon"], "invalid choice"),
    (["franke", "--ranks", "0", "2"], "at least 1"),
    (["franke", "--ranks", "8", "--points", "4", "--batch-size", "8"], "fewer ranks"),
    (["franke", "--ranks", "1", "8", "--points", "4", "--batch-size", "8"], "at most 4"),
    (["franke", "--ranks", "3", "--quick"], "divisible"),
    (["franke", "--scaling", "diagonal"], "invalid choice"),
    (["franke", "--ranks", "4096"], "--oversubscribe"),
])
def test_bench_bad_input_writes_nothing(tmp_path, capsys, argv, match):
    _bench_fails(capsys, [*argv, "--out", str(tmp_path)], match)
    assert not list(tmp_path.iterdir())


@needs_mnist
@pytest.mark.parametrize("state", ["missing", "truncated"])
def test_bench_bad_mnist_writes_nothing(tmp_path, capsys, monkeypatch, state):
    data = tmp_path / "data"
    data.mkdir()
    if state == "truncated":
        _copy_split(MNIST_DIR, data)
        labels = data / "t10k-labels-idx1-ubyte.gz"
        labels.write_bytes(gzip.compress(gzip.decompress(labels.read_bytes())[:-10]))
    monkeypatch.setenv(mnist.ENV_VAR, str(data))
    out = tmp_path / "out"
    _bench_fails(capsys, ["mnist", "--quick", "--ranks", "1", "--out", str(out)],
                 "not found" if state == "missing" else "truncated")
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.mpi
def test_bench_franke_end_to_end(tmp_path, capsys):
    argv = ["franke", "--quick", "--backends", "mpi", "nccl", "--ranks", "1", "2",
            "--repeats", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    nccl_runs = [r for r in (1, 2) if not bench.skip_reason("nccl", r)]  # GPUs here
    assert ("skip nccl" in text) == (len(nccl_runs) < 2)
    assert "speed-up" in text and "where the time went" in text
    lines = (tmp_path / "franke_strong.csv").read_text().splitlines()
    runs = 2 * (2 + len(nccl_runs))  # repeats x (mpi at 1 and 2 ranks, nccl where it runs)
    assert lines[0] == ",".join(bench.FIELDS) and len(lines) == 1 + runs
    assert (tmp_path / "franke_strong.png").stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "franke_strong.csv").read_text().splitlines()))
    losses = {r["ranks"]: r["final_loss"] for r in rows if r["backend"] == "mpi"}
    assert float(losses["1"]) == pytest.approx(float(losses["2"]), rel=1e-6)  # strong: same updates
    for r in rows:  # every run's phases: before, during and after training
        parts = [float(r[k]) for k in ("backend_time", "data_time", "optimizer_time",
                                        "total_time", "eval_time", "close_time")]
        assert all(p >= 0 for p in parts) and sum(parts) <= float(r["wall_time"]) * 1.01
        steps = int(r["epochs"]) * int(r["steps_per_epoch"])
        assert float(r["time_per_step"]) == pytest.approx(float(r["train_time"]) / steps)
    phases = {r["phase"]: float(r["seconds"])
              for r in csv.DictReader(
                  (tmp_path / "franke_strong_phases.csv").read_text().splitlines())}
    job = phases["rank job, mpiexec start to exit"]
    assert phases["rank job: training"] == pytest.approx(sum(float(r["train_time"]) for r in rows))
    assert job == pytest.approx(phases["rank job: training"]
                                + phases["rank job: everything but training"])
    assert phases["import torch"] > 0 and job > phases["import torch"]


@needs_mnist
@pytest.mark.slow
@pytest.mark.mpi
def test_bench_mnist_saves_pictures(tmp_path, monkeypatch):
    monkeypatch.setenv(mnist.ENV_VAR, str(MNIST_DIR))
    argv = ["mnist", "--quick", "--points", "256", "--epochs", "1", "--backends", "mpi",
            "--ranks", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"mnist_weak.csv", "mnist_reconstructions.png", "mnist_latent_walk.png"} <= names
    assert "mnist_weak.png" not in names  # one rank count: nothing to plot against ranks


def test_a_named_workload_takes_its_own_configuration_only():
    """The loop's config is typed (FrankeConfig | MNISTConfig); the wrong one says so."""
    from pcourse.workloads import make_workload
    from pcourse.workloads.config import MNISTConfig

    with pytest.raises(TypeError, match="'franke' takes a FrankeConfig .*got MNISTConfig"):
        train("franke", None, MNISTConfig.quick(), progress=False)
    with pytest.raises(TypeError, match="'mnist' takes a MNISTConfig .*got dict"):
        make_workload("mnist", {"epochs": 1})
