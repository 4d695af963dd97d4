import os

import pytest

# Tests share two cores: one thread per process keeps multi-rank tests from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from table_data import table_dataset  # noqa: E402

from bench import http_files  # noqa: E402
from ddptrain.data.synth import SynthSpec, write  # noqa: E402

TINY = SynthSpec(classes=3, train_per_class=8, val_per_class=5, size=24, seed=0)


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict[str, str]:
    """The caches of this session's runs: the built-in dataset and torch hub never touch the
    user's real cache."""
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"
    return {"XDG_CACHE_HOME": str(cache), "TORCH_HOME": str(cache / "torch")}


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(cache_env):
    """For the whole session, module fixtures included (they start before a test's own)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in cache_env.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """3 classes, 24 train and 15 val images of 24 px: an uneven val set for 2 and 4 ranks."""
    return write(TINY, tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture
def http_server():
    """serve(root, ranges=True, failures=0, auth=None) -> the base URL of a real HTTP server on
    127.0.0.1 for the files under root (bench/http_files.py), running until the test ends; the
    server itself is serve.servers[-1]."""
    servers = []

    def serve(root, ranges: bool = True, failures: int = 0, auth: str | None = None) -> str:
        server = http_files.serve(root, ranges, failures, auth)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    serve.servers = servers
    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def tiny_parquet(tiny_data, tmp_path_factory):
    """tiny_data as a Parquet table set, written by datasets: train in two files of row groups
    of 4 rows, val in one; the rows in the folder's order, the images its files' bytes."""
    out = tmp_path_factory.mktemp("tables") / "parquet"
    train, val = table_dataset(tiny_data, "train"), table_dataset(tiny_data, "val")
    train.select(range(10)).to_parquet(out / "train" / "part-0.parquet", batch_size=4)
    train.select(range(10, len(train))).to_parquet(out / "train" / "part-1.parquet", batch_size=4)
    val.to_parquet(out / "val" / "part-0.parquet")
    return out


@pytest.fixture(scope="session")
def tiny_dataset_dict(tiny_data, tmp_path_factory):
    """tiny_data as a DatasetDict saved with save_to_disk, splits train and validation."""
    import datasets

    out = tmp_path_factory.mktemp("tables") / "saved"
    splits = {"train": "train", "validation": "val"}
    datasets.DatasetDict({k: table_dataset(tiny_data, v) for k, v in splits.items()}).save_to_disk(
        out
    )
    return out


@pytest.fixture(scope="session")
def tiny_packed(tiny_data, tmp_path_factory):
    """tiny_data packed (`ddptrain pack`, byte for byte) into shards of about 20 kB: 4 train
    shards and 2 val shards, so that batches and val shards cross shard boundaries."""
    from ddptrain.data.pack import pack

    out = tmp_path_factory.mktemp("packed") / "tiny"
    pack(str(tiny_data), str(out), shard_size=0.02, workers=0)
    return out
