"""A packed set in S3: moto's standalone server on 127.0.0.1 (the S3 API over real HTTP; no mock
of any client), the bucket filled with boto3, and `ddptrain train s3://...` pointed at the server
by the environment alone, as a user points s3:// at their own endpoint (AWS_ENDPOINT_URL, which
botocore, and so s3fs, reads). The run trains to the folder's weights; a missing key is named."""

import pytest
from cli import assert_same_training, ddptrain, ok, tiny_args
from test_user_errors import assert_user_error

from ddptrain.data.shard_index import INDEX

try:
    import boto3
    import s3fs  # noqa: F401 (what fsspec reads s3:// with, in the run)
    from moto.server import ThreadedMotoServer
except ImportError as err:
    pytest.skip(f"needs moto[server] and s3fs (the dev extra): {err}", allow_module_level=True)

BUCKET = "ddptrain-tiny"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",  # moto takes any
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3(tiny_packed):
    """The environment that points a run at an S3 server on 127.0.0.1 (a free port) holding
    tiny_packed at s3://BUCKET/tiny, and at s3://BUCKET/no-shard without train/000003.tar."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)  # port 0: the system picks
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", **CREDENTIALS}
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(p for p in tiny_packed.rglob("*") if p.is_file()):
        name = path.relative_to(tiny_packed).as_posix()
        client.upload_file(str(path), BUCKET, f"tiny/{name}")
        if name != "train/000003.tar":
            client.upload_file(str(path), BUCKET, f"no-shard/{name}")
    yield env
    server.stop()


def test_a_packed_set_in_s3_trains_to_the_folders_weights(s3, one_rank_run, tmp_path):
    url, out = f"s3://{BUCKET}/tiny", tmp_path / "run"
    # Loader workers: each makes its own S3 client after the fork.
    ok(ddptrain("train", *tiny_args(url, out), "-j", 2, "--cache-dir", tmp_path / "cache", env=s3))
    assert_same_training(one_rank_run, out)  # one_rank_run: the same tiny_args on tiny_data
    assert not list((tmp_path / "cache").rglob("*.tar"))  # read by ranges, nothing kept whole


def test_a_missing_key_is_named_by_its_s3_url_in_one_line(s3, tmp_path):
    result = ddptrain("train", *tiny_args(f"s3://{BUCKET}/nowhere", tmp_path / "a"), env=s3)
    assert_user_error(result, f"s3://{BUCKET}/nowhere/{INDEX}: not found (404)")
    result = ddptrain("train", *tiny_args(f"s3://{BUCKET}/no-shard", tmp_path / "b"), env=s3)
    shard = f"s3://{BUCKET}/no-shard/train/000003.tar"
    assert_user_error(result, f"DATA: shard {shard} is missing (listed in s3://{BUCKET}/no-shard/")
