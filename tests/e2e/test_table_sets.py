"""Training on table sets (Parquet, a saved DatasetDict): the weights of the folder they were made
of, resumed mid-epoch bitwise, refused on a changed table, and a bad row said in one line.

The tables hold tiny_data's images as its files' own bytes (datasets stores the bytes it is
given, without re-encoding), in the folder's order, with the folder's classes as ClassLabel
names: the same samples at the same indices, so the same seeded run gives the same weights.
"""

import shutil

from cli import (
    assert_same_training,
    ddptrain,
    ok,
    resumable_args,
    tiny_args,
    torchrun,
    training_state,
    val_records,
)
from table_data import table_dataset, table_rows, with_features, write_table_set
from test_user_errors import assert_user_error


def test_a_parquet_set_trains_to_the_folders_weights_and_a_changed_one_is_refused(
    tiny_data, tiny_parquet, tmp_path, one_rank_run
):
    data, out = shutil.copytree(tiny_parquet, tmp_path / "data"), tmp_path / "run"
    ok(ddptrain("train", *tiny_args(data, out)))
    assert_same_training(one_rank_run, out)  # one_rank_run: the same flags on tiny_data

    # part-0's rows with two labels swapped: as many images, other (row, label) pairs.
    rows, classes = table_rows(tiny_data, "train")
    rows = {column: values[:10] for column, values in rows.items()}
    rows["label"][0], rows["label"][9] = rows["label"][9], rows["label"][0]
    with_features(rows, classes).to_parquet(data / "train" / "part-0.parquet", batch_size=4)
    result = ddptrain("train", *tiny_args(data, out), "--resume", "auto", "--epochs", 2)
    assert_user_error(result, "DATA has as many train images as", "but other files")


def test_a_saved_dataset_dict_killed_mid_epoch_resumes_to_the_folders_weights(
    tiny_dataset_dict, tmp_path, uninterrupted
):
    out, marker = tmp_path / "run", tmp_path / "killed"
    # Rank 1 dies before step 5; the restart resumes from step 4, mid-epoch 2.
    kill = {"DDPTRAIN_TEST_KILL": "between:1:5", "DDPTRAIN_TEST_KILL_ONCE": str(marker)}
    resumed = ok(torchrun(2, *resumable_args(tiny_dataset_dict, out), env=kill, restarts=1))
    assert marker.exists(), "the fault never fired"
    assert "(epoch 1, step 1 of the next" in resumed.stdout
    assert_same_training(uninterrupted, out)  # uninterrupted: the same flags on tiny_data


def test_a_label_out_of_range_is_one_line_naming_file_and_row(tiny_data, tmp_path):
    rows, classes = table_rows(tiny_data, "val")
    rows["label"][4] = -1  # ClassLabel's "no label"
    data = write_table_set(tmp_path / "data", with_features(rows, classes))
    result = ddptrain("train", *tiny_args(data, tmp_path / "run"))
    bad = data / "val" / "part-0.parquet"
    assert_user_error(result, f"{bad}:4: label -1 is out of range: the classes are 0..2")


def test_a_row_without_an_image_ends_every_rank_and_skip_trains_without_it(tiny_data, tmp_path):
    rows, classes = table_rows(tiny_data, "val")
    rows["image"][14] = None  # the last val row: in rank 1's shard only
    data = write_table_set(tmp_path / "data", with_features(rows, classes))
    table_dataset(tiny_data, "train").to_parquet(data / "train" / "part-0.parquet")
    bad = data / "val" / "part-0.parquet"

    checked = ddptrain("check", data)
    assert checked.returncode == 2
    assert checked.stdout == f"{bad}:14: no image (null in column 'image')\n"

    # Met by rank 1's loader worker in the first evaluation: rank 0 ends too.
    args = tiny_args(data, tmp_path / "failed", "-j", 1)
    failed = torchrun(2, "train", *args)
    assert_user_error(failed, f"cannot read image {bad}:14: no image", traceback_allowed=True)
    assert not (tmp_path / "failed" / "checkpoint.pt").exists()

    out = tmp_path / "skipped"
    ok(ddptrain("train", *tiny_args(data, out), "--bad-images", "skip"))
    assert [r["samples"] for r in val_records(out)] == [14]
    assert training_state(out)["global_step"] == 3
